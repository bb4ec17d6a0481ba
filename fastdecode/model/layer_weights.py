"""One decoder layer's weights, gathered from a checkpoint's HF parameter names into the
layout the S-part computes with: Q, K and V as one fused projection, gate and up as one, the
routed experts of a mixture-of-experts layer stacked per expert (moe.py).

Checkpoints store these fused or not by family: Phi-3's qkv_proj and gate_up_proj already are;
Mixtral's experts sit under block_sparse_moe, the Qwen MoE families' under mlp; either may come
per expert or, written by transformers v5, fused. A projection may be a tensor or an fp8 weight
(fp8.py): fusing concatenates rows, and with them an fp8 weight's per-row scales.
"""
from __future__ import annotations

import torch

from fastdecode.model.config import ModelConfig
from fastdecode.model.fp8 import Fp8Weight, cat_out


def norm_weight(config: ModelConfig, w: torch.Tensor) -> torch.Tensor:
    """A norm's weight as the S-part applies it: Gemma's 1 + w in float32 (HF adds in float32
    before scaling), every other family's w as stored."""
    return 1.0 + w.float() if config.gemma_norms else w


def layer_weights(config: ModelConfig, w: dict, i: int) -> dict:
    """Layer i's weights (w: HF names -> tensors on the device in the activation dtype, or
    Fp8Weight for fp8 projections).

    Shapes: h = hidden, Hq/Hkv = query/KV heads, D = head_dim, I = intermediate."""
    c = config
    p = f"model.layers.{i}."
    a = p + "self_attn."
    if a + "qkv_proj.weight" in w:                                      # Phi-3: fused in the checkpoint
        w_qkv, b_qkv = w[a + "qkv_proj.weight"], w.get(a + "qkv_proj.bias")
    else:
        w_qkv = cat_out([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        b_qkv = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]) \
            if c.qkv_bias else None
    layer = {
        "ln1": norm_weight(c, w[p + "input_layernorm.weight"]),         # [h]
        "w_qkv": w_qkv.contiguous(),                                    # [Hq*D + 2*Hkv*D, h]
        "b_qkv": b_qkv,                                                 # [Hq*D + 2*Hkv*D] or None
        "w_o": w[a + "o_proj.weight"],                                  # [h, Hq*D]
        "b_o": w.get(a + "o_proj.bias"),                                # [h] (attention_bias) or None
        # Llama-style: the norm before the MLP; Gemma: the norm of the attention output
        "ln2": norm_weight(c, w[p + "post_attention_layernorm.weight"]),   # [h]
        "mlp": moe_layer(c, w, p) if i in c.moe_layers else dense_mlp(w, p),
    }
    if c.gemma_norms:
        layer["ln_pre_ff"] = norm_weight(c, w[p + "pre_feedforward_layernorm.weight"])     # [h]
        layer["ln_post_ff"] = norm_weight(c, w[p + "post_feedforward_layernorm.weight"])   # [h]
    if c.qk_norm:
        layer["q_norm"] = norm_weight(c, w[a + "q_norm.weight"])       # [D]
        layer["k_norm"] = norm_weight(c, w[a + "k_norm.weight"])       # [D]
    if c.attn_sinks:
        layer["sinks"] = w[a + "sinks"].float()                         # [Hq]
    return layer


def dense_mlp(w: dict, p: str) -> tuple:
    """(gate|up [2I, h], down [h, I]) of a gated MLP."""
    m = p + "mlp."
    if m + "gate_up_proj.weight" in w:                                  # Phi-3: fused, gate rows first
        gate_up = w[m + "gate_up_proj.weight"]
    else:
        gate_up = cat_out([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]])
    return gate_up.contiguous(), w[m + "down_proj.weight"]


def moe_layer(c: ModelConfig, w: dict, p: str):
    """The routed experts (and Qwen2-MoE's gated shared expert) of the layer under prefix p."""
    from fastdecode.model.moe import MoESpec, SparseMoE, stack_experts  # only MoE models need it

    # stack_experts also finds Mixtral's experts under mlp. (as transformers v5 may save them)
    s = stack_experts(w, p + ("block_sparse_moe." if c.model_type == "mixtral" else "mlp."), c.num_experts)
    # HF's Mixtral keeps the routing weights in float32 until after the scale; the Qwen MoE
    # families cast them to the activation dtype first
    spec = MoESpec(c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, act=c.hidden_act,
                   fp32_routing_weights=c.model_type == "mixtral")
    return SparseMoE(spec, s["router"], s["gate_up"], s["down"], s.get("shared_gate_up"), s.get("shared_down"),
                     s.get("shared_gate"))


def fp8_weights(layers: list[dict]):
    """Every Fp8Weight of the layers: projections, dense MLPs' and routed and shared experts'."""
    for layer in layers:
        for v in layer.values():
            if isinstance(v, tuple):                                    # dense MLP (gate_up, down)
                parts = v
            elif hasattr(v, "gate_up"):                                  # SparseMoE
                parts = (v.gate_up, v.down, v.shared_gate_up, v.shared_down)
            else:
                parts = (v,)
            yield from (p for p in parts if isinstance(p, Fp8Weight))
