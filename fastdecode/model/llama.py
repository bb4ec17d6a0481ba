"""The S-part of a Llama-family decoder: every layer except attention over the KV-cache.

A layer is cut at attention: `qkv()` / `qkv_packed()` (RMSNorm, fused QKV projection, RoPE) give
the rows the R-workers need; `post_attn()` (O projection, residual, RMSNorm, SwiGLU MLP,
residual) consumes what they return. Numerics follow HF transformers' Llama (RMSNorm and RoPE in
float32) so greedy outputs match it token for token in float32; the elementwise passes run as
fused kernels on a CUDA S-worker in bf16/fp16 (ops.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdecode.model.config import ModelConfig
from fastdecode.model.ops import SPartOps, apply_rope


class Rope:
    """cos/sin tables for the model's RoPE, indexed by absolute position."""

    def __init__(self, config: ModelConfig, device, rope_freqs: torch.Tensor | None = None):
        dim = config.head_dim
        if config.rope_type == "default":
            inv_freq = 1.0 / (config.rope_theta ** (
                torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
            self.scaling = 1.0
        else:
            inv_freq, self.scaling = _hf_rope_init(config, device)
        if rope_freqs is not None:           # GGUF llama3: per-frequency factors stored as a tensor
            inv_freq = inv_freq / rope_freqs.to(device=device, dtype=torch.float)
        self.inv_freq = inv_freq              # [D/2] float32
        self.max_position = config.max_position
        self._cos = self._sin = None
        self._extend(min(config.max_position, 4096), device)

    def _extend(self, length: int, device):
        pos = torch.arange(length, device=device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]          # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                # [L, D]
        self._cos = emb.cos() * self.scaling
        self._sin = emb.sin() * self.scaling

    def cos_sin(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [n] int64 -> cos, sin: [n, 1, D] float32 (max_position from the host saves a sync)
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else -1
        need = max_position + 1
        if need > self._cos.shape[0]:
            self._extend(max(need, 2 * self._cos.shape[0]), positions.device)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]


def _hf_rope_init(config: ModelConfig, device):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = {k: v for k, v in config.hf_config.items() if not k.startswith("gguf_")}
    hf_config = AutoConfig.for_model(**hf)
    return ROPE_INIT_FUNCTIONS[config.rope_type](hf_config, device)


class LlamaSPart:
    """Weights and dense compute of one model on one device.

    Shapes: n = rows in the call (sequences in decode, prompt tokens in prefill),
    h = hidden, Hq/Hkv = query/KV heads, D = head_dim, I = intermediate.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device, dtype: torch.dtype):
        c = self.config = config
        self.device, self.dtype = torch.device(device), dtype
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items() if k != "rope_freqs"}
        self.embed = w["model.embed_tokens.weight"]                       # [V, h]
        self.lm_head = self.embed if c.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = w["model.norm.weight"]                          # [h]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {
                "ln1": w[p + "input_layernorm.weight"],                   # [h]
                "w_qkv": torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"],
                                    w[a + "v_proj.weight"]]).contiguous(),   # [Hq*D + 2*Hkv*D, h]
                "b_qkv": torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
                if c.qkv_bias else None,
                "w_o": w[a + "o_proj.weight"],                            # [h, Hq*D]
                "ln2": w[p + "post_attention_layernorm.weight"],          # [h]
                "w_gate_up": torch.cat([w[p + "mlp.gate_proj.weight"],
                                        w[p + "mlp.up_proj.weight"]]).contiguous(),  # [2I, h]
                "w_down": w[p + "mlp.down_proj.weight"],                  # [h, I]
            }
            self.layers.append(layer)
        self.rope = Rope(c, self.device, weights.get("rope_freqs"))
        self.scale = c.head_dim ** -0.5
        self.ops = SPartOps(self.device, dtype, c.hidden_size)

    # ------------------------------------------------------------------ per-layer halves

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[token_ids]                                       # [n] -> [n, h]

    def qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [n, h] residual stream -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] (RoPE applied)."""
        return self.rope_split(self.qkv_proj(i, x), cos, sin)

    def rope_split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """qkv: [n, (Hq + 2 Hkv) D] projections -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] (RoPE applied)."""
        c = self.config
        n = qkv.shape[0]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(q.view(n, c.num_heads, c.head_dim), cos, sin, self.dtype)
        k = apply_rope(k.view(n, c.num_kv_heads, c.head_dim), cos, sin, self.dtype)
        return q, k, v.reshape(n, c.num_kv_heads, c.head_dim)

    def qkv_packed(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout,
                   out: torch.Tensor) -> None:
        """As qkv(), written straight into `out` in the wire layout (rpart.base.TorchWireLayout)."""
        self.rope_pack(self.qkv_proj(i, x), cos, sin, layout, out)

    def rope_pack(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, out: torch.Tensor) -> None:
        """qkv: [n, (Hq + 2 Hkv) D] projections -> RoPE'd q, k and v in the wire layout in `out`."""
        c = self.config
        self.ops.rope_pack(qkv, cos, sin, layout, out, c.num_heads, c.num_kv_heads, c.head_dim)

    def qkv_proj(self, i: int, x: torch.Tensor) -> torch.Tensor:
        L = self.layers[i]
        h = self.ops.rms_norm(x, L["ln1"], self.config.rms_norm_eps)
        return F.linear(h, L["w_qkv"], L["b_qkv"])                        # [n, (Hq + 2 Hkv) D]

    def post_attn(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x: [n, h], o: [n, Hq, D] attention output -> next layer's residual stream [n, h]."""
        c, L = self.config, self.layers[i]
        attn = F.linear(o.reshape(o.shape[0], -1).to(self.dtype), L["w_o"])
        x, h = self.ops.add_rms_norm(x, attn, L["ln2"], c.rms_norm_eps)
        act = self.ops.silu_mul(F.linear(h, L["w_gate_up"]))              # [n, I]
        return x + F.linear(act, L["w_down"])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, h] -> float32 logits [n, V]."""
        h = self.ops.rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    # ------------------------------------------------------------------ prefill attention

    def prompt_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                         context: list | None = None) -> torch.Tensor:
        """Causal attention within each prompt (or prompt chunk) of a packed batch.

        q: [T, Hq, D], k/v: [T, Hkv, D] with T = sum(lengths) -> o: [T, Hq, D]. context[i], where
        given and not None: the K/V [p + n_i, Hkv, D] chunk i attends to, its earlier chunks' first.
        """
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(lengths):
            # [1, H, n, D] views: SDPA's fused (flash) kernels want a batch dimension; without one
            # the CPU falls back to the unfused math path, ~6x slower on a 1,100-token prompt
            ctx = context[i] if context is not None else None
            qs = q[start:start + n].transpose(0, 1)[None]
            ks, vs = (t.transpose(0, 1)[None] for t in ((k[start:start + n], v[start:start + n]) if ctx is None
                                                         else ctx))
            out[start:start + n] = causal_attention(qs, ks, vs, self.scale)[0].transpose(0, 1)
            start += n
        return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [1, Hq, n, D], k/v: [1, Hkv, p + n, D] -> causal attention [1, Hq, n, D], query i at
    position p + i; grouped queries share their K/V head (SDPA's enable_gqa where this torch has
    it, else repeated K/V)."""
    global _sdpa_gqa
    n, total = q.shape[2], k.shape[2]
    mask = None
    if total != n:        # a chunk after earlier ones: the causal mask aligned to the last key
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and _sdpa_gqa:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                  enable_gqa=True)
        except TypeError:          # torch < 2.5
            _sdpa_gqa = False
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


_sdpa_gqa = True        # this torch's SDPA takes enable_gqa (until a call says otherwise)
