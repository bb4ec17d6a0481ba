"""The S-part of a decoder: every layer except attention over the KV-cache.

A layer is cut at attention: `qkv_proj()` (norm, fused QKV projection) and `rope_split()` /
`rope_pack()` (q/k norms, RoPE, the wire layout) give the rows the R-workers need;
`post_attn()` (O projection, residual, norms, MLP or routed experts, residual) consumes what
they return. Families differ in what those steps do (ModelConfig says which): Gemma's
(1 + w) norms around attention and the MLP and its scaled embedding, q/k norms (Qwen 3,
Gemma 3), partial RoPE (Phi-3), per-layer RoPE (Gemma 3), soft-capped logits (Gemma 2), a GeGLU
MLP, mixture-of-experts MLPs. Numerics follow HF transformers (norms and RoPE in float32, where
HF rounds) so greedy outputs match it in float32. A CPU S-part in bf16/fp16 keeps the residual
stream in float32 (`residual_dtype`; norms hand the GEMMs their activation dtype): its greedy
tokens then match float32's more often (the embedded model, teacher-forced: 98.95% -> 99.19%)
for ~1% of a decode step, where HF and vLLM round the residual to bf16. The elementwise passes of the Llama-style
families run as fused kernels on a CUDA S-worker in bf16/fp16 (ops.py). Every projection goes
through fp8.linear, so a layer's weights may be fp8 (`--quantization fp8`, fp8.py) with no
change here.

A tensor-parallel rank (`tp`, one of T S-ranks: shard.py) holds 1/T of every projection and a
config of its own heads and MLP rows: the O projection's and the MLP's outputs are partial sums,
all-reduced before their bias and the residual (Megatron's two all-reduces a layer), and the LM
head's logits are its slice of the vocabulary, gathered on rank 0. The rest runs as it is.

Shapes: n = rows in the call (sequences in decode, prompt tokens in prefill), h = hidden,
Hq/Hkv = query/KV heads, D = head_dim, V = vocabulary.
"""
from __future__ import annotations

import torch

from fastdecode.model import fp8_gemm
from fastdecode.model import prompt_attention as pa
from fastdecode.model.config import ModelConfig
from fastdecode.model.fp8 import Fp8Weight, linear
from fastdecode.model.layer_weights import fp8_weights, layer_weights, norm_weight
from fastdecode.model.logit_top import top_in_float32
from fastdecode.model.ops import SPartOps, apply_rope, gemma_rms_norm_torch, pack, rms_norm_torch
from fastdecode.model.rope import Rope, RopeTable


class SPart:
    """Weights and dense compute of one model on one device. max_model_len: the job's context
    (RoPE kinds that depend on it: longrope's short or long factors)."""

    def __init__(self, config: ModelConfig, weights: dict, device, dtype: torch.dtype,
                 max_model_len: int | None = None, tp=None, vocab_size: int | None = None):
        c = self.config = config
        self.tp = tp                   # the tensor-parallel group (tp/group.py), or None
        self.vocab_size = vocab_size or c.vocab_size      # the model's (the LM head's slice may be padded)
        self.device, self.dtype = torch.device(device), dtype
        # (an Fp8Weight moves to the device and stays e4m3)
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items() if k != "rope_freqs"}
        self.fp8 = any(isinstance(v, Fp8Weight) for v in w.values())
        # the fp8 GEMM path is probed now, before any CUDA graph capture could meet the probe
        self.fp8_path = fp8_gemm.path_for(self.device, dtype) if self.fp8 else None
        self.embed = w["model.embed_tokens.weight"]                       # [V, h]
        self.lm_head = self.embed if c.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = norm_weight(c, w["model.norm.weight"])          # [h]
        # Gemma scales the embedding by sqrt(h) rounded to the activation dtype, as HF does
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=torch.float32).to(device=self.device, dtype=dtype) \
            if c.gemma_norms else None
        self.layers = [layer_weights(c, w, i) for i in range(c.num_layers)]
        del w
        if self.fp8 and self.fp8_path.keep_dense:
            for weight in fp8_weights(self.layers):
                weight.keep_dense(dtype)
        self.rope = Rope(c, self.device, max_model_len, weights.get("rope_freqs"))
        self.scale = c.attn_scale or c.head_dim ** -0.5
        self.ops = SPartOps(self.device, dtype, c.hidden_size)
        # the fused RoPE + wire packing kernel covers whole-head RoPE without q/k norms
        self._plain_rope = not c.qk_norm and c.rotary_dim == c.head_dim
        self.compiled = None           # the per-layer halves under torch.compile (compiled.py), or eager
        self.lm_head_packed = None     # the LM head in oneDNN's layout (packed.py), where packed
        # the residual stream x [n, h]: float32 on a CPU in half precision (the module docstring)
        self.residual_dtype = torch.float32 if self.device.type == "cpu" else dtype

    @property
    def graph_safe(self) -> bool:
        """post_attn() may be captured in a CUDA graph (routed experts pick their rows at run time;
        a tensor-parallel rank's all-reduces run eagerly)."""
        return not self.config.moe_layers and self.tp is None

    # ------------------------------------------------------------------ norms

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [n, h] -> the family's RMSNorm [n, h] in `dtype` (default: the activation dtype, what
        the GEMMs take, whatever the residual stream's)."""
        if self.config.gemma_norms:
            y = gemma_rms_norm_torch(x, weight, self.config.rms_norm_eps)
        else:
            y = self.ops.rms_norm(x, weight, self.config.rms_norm_eps)
        return y.to(dtype or self.dtype)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [n, H, D] -> RMSNorm over each head's D dims (q/k norms)."""
        if self.config.gemma_norms:
            return gemma_rms_norm_torch(x, weight, self.config.rms_norm_eps)
        return rms_norm_torch(x, weight, self.config.rms_norm_eps)

    # ------------------------------------------------------------------ per-layer halves

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[token_ids]                                          # [n] -> [n, h]
        x = x * self.embed_scale if self.embed_scale is not None else x
        return x.to(self.residual_dtype)

    def qkv(self, layer: int, x: torch.Tensor, rope: RopeTable):
        """x: [n, h] residual stream -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] (RoPE applied)."""
        return self.rope_split(layer, self.qkv_proj(layer, x), rope)

    def rope_split(self, layer: int, qkv: torch.Tensor, rope: RopeTable):
        """qkv: [n, (Hq + 2 Hkv) D] projections -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]
        (q/k norms and the layer's RoPE applied)."""
        c, L = self.config, self.layers[layer]
        n = qkv.shape[0]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q, k = q.view(n, c.num_heads, c.head_dim), k.view(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:                      # after the projection, before RoPE (as HF)
            q, k = self._head_norm(q, L["q_norm"]), self._head_norm(k, L["k_norm"])
        cos, sin = rope.layer(layer)
        return (apply_rope(q, cos, sin, self.dtype), apply_rope(k, cos, sin, self.dtype),
                v.reshape(n, c.num_kv_heads, c.head_dim))

    def qkv_packed(self, layer: int, x: torch.Tensor, rope: RopeTable, layout, out: torch.Tensor) -> None:
        """As qkv(), written straight into `out` in the wire layout (rpart.base.TorchWireLayout)."""
        self.rope_pack(layer, self.qkv_proj(layer, x), rope, layout, out)

    def rope_pack(self, layer: int, qkv: torch.Tensor, rope: RopeTable, layout, out: torch.Tensor) -> None:
        """qkv: [n, (Hq + 2 Hkv) D] projections -> q, k (normed, RoPE'd) and v in the wire layout in `out`."""
        c = self.config
        if self._plain_rope:
            cos, sin = rope.layer(layer)
            self.ops.rope_pack(qkv, cos, sin, layout, out, c.num_heads, c.num_kv_heads, c.head_dim)
        else:
            pack(*self.rope_split(layer, qkv, rope), layout, out)

    def qkv_proj(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x: [n, h] residual stream -> projections [n, (Hq + 2 Hkv) D] (compiled where self.compiled is)."""
        fn = self.compiled.qkv_proj if self.compiled is not None else self.layer_qkv_proj
        return fn(self.layers[layer], x)

    def post_attn(self, layer: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x: [n, h], o: [n, Hq, D] attention output -> next layer's residual stream [n, h]."""
        fn = self.compiled.post_attn if self.compiled is not None else self.layer_post_attn
        return fn(self.layers[layer], x, o)

    # the same on a layer's weights L (layer_weights.py): what compiled.py compiles, one graph for
    # every layer since the weights are inputs, not constants

    def layer_qkv_proj(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        h = self._norm(x, L["ln1"])
        return linear(h, L["w_qkv"], L["b_qkv"])                          # [n, (Hq + 2 Hkv) D]

    def layer_post_attn(self, L: dict, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        c = self.config
        attn = self._reduced(linear(o.reshape(o.shape[0], -1).to(self.dtype), L["w_o"],
                                    None if self.tp else L["b_o"]), L["b_o"])      # [n, h]
        if c.gemma_norms:              # norms on both sides of attention and of the MLP
            x = x + self._norm(attn, L["ln2"])
            return x + self._norm(self._mlp(L, self._norm(x, L["ln_pre_ff"])), L["ln_post_ff"])
        x, h = self.ops.add_rms_norm(x, attn, L["ln2"], c.rms_norm_eps)
        return x + self._mlp(L, h.to(self.dtype))

    def _mlp(self, L: dict, h: torch.Tensor) -> torch.Tensor:
        """h: [n, h] normed -> the layer's MLP (gated dense, or routed experts) [n, h]."""
        if isinstance(L["mlp"], tuple):
            gate_up, down = L["mlp"]                                       # [2I, h], [h, I]
            return self._reduced(linear(self.ops.act_mul(linear(h, gate_up), self.config.hidden_act), down))
        return self._reduced(L["mlp"](h))

    def _reduced(self, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A row-parallel projection's output y [n, h]: on a tensor-parallel rank the sum of every
        rank's partial y (all-reduced), then the bias, once."""
        if self.tp is None:
            return y
        y = self.tp.all_reduce(y)
        return y + bias if bias is not None else y

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [n, h] -> float32 logits [n, V] (soft-capped where the family caps them). A
        tensor-parallel rank computes its slice of the vocabulary and rank 0 gathers them all;
        the other ranks get None. In bf16/fp16 the logits at each row's top are recomputed in
        float32 (top_in_float32)."""
        cap = self.config.final_softcap
        h = self._norm(x, self.final_norm)                                # [n, h]
        logits = linear(h, self.lm_head_packed or self.lm_head)          # [n, V] activation dtype ([n, V/T])
        if cap:                        # in the activation dtype, as HF
            logits = torch.tanh(logits / cap) * cap
        if self.tp is not None:
            logits = self.tp.gather_columns(logits)                       # [n, T * V/T] on rank 0
            if logits is None:
                return None
            return logits[:, :self.vocab_size].float()
        logits = logits.float()
        if self.lm_head.dtype == torch.float32:
            return logits
        return top_in_float32(logits, self._norm(x.float(), self.final_norm.float(), torch.float32), self.lm_head,
                              cap)

    # ------------------------------------------------------------------ prefill attention

    def prompt_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                         context: list | None = None) -> torch.Tensor:
        """Causal attention within each prompt (or prompt chunk) of a packed batch, with the
        layer's window, soft-cap, scale and sinks.

        q: [T, Hq, D], k/v: [T, Hkv, D] with T = sum(lengths) -> o: [T, Hq, D]. context[i], where
        given and not None: the K/V [p + n_i, Hkv, D] chunk i attends to, its earlier chunks' first.
        """
        c = self.config
        return pa.prompt_attention(q, k, v, lengths, context, self.scale, c.window(layer), c.attn_softcap,
                                   self.sinks(layer))

    def sinks(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s learned sink logits [Hq] float32, or None (no family here has them)."""
        return self.layers[layer].get("sinks")
