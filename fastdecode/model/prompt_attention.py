"""Prefill attention on the S-worker: causal attention within each prompt (or prompt chunk) of
a packed batch, with the layer's sliding window, logit soft-cap, scale and sink logits.

Three paths, by what the layer asks:
  - plain causal (no window inside the keys, no soft-cap, no sinks): the kernel module's causal
    pass where it applies (bf16 on a CPU with AVX512-BF16: prompt_kernel.py), else SDPA's fused kernel;
  - a sliding window: SDPA over blocks of queries, each against only the keys its window
    reaches, with a boolean mask (O(n W) work, not O(n^2));
  - soft-cap or sinks (SDPA can do neither): an explicit float32 path over blocks of queries,
    in HF's order: scale, soft-cap, mask, softmax.
A chunk after earlier ones attends [earlier chunks' K/V | its own]: query i sits at position
p + i (p: the earlier keys), so the causal and window masks are aligned to the last key.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdecode.model import prompt_kernel

_EXPLICIT_BYTES = 1 << 26     # float32 scores per query block of the explicit path (64 MB)
_MIN_BLOCK = 64


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], context: list | None,
                     scale: float, window: int = 0, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] with T = sum(lengths) -> o: [T, Hq, D]. context[i], where
    given and not None: the K/V [p + n_i, Hkv, D] chunk i attends to, its earlier chunks' first.
    window: keys a query attends, its own included (0: all); sinks: [Hq] float32 logits."""
    out = torch.empty_like(q)
    start = 0
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        ctx = context[i] if context is not None else None
        ki, vi = (k[start:start + n], v[start:start + n]) if ctx is None else ctx
        out[start:start + n] = _attend(q[start:start + n], ki, vi, scale, window, softcap, sinks)
        start += n
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, softcap: float | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """q: [n, Hq, D], k/v: [p + n, Hkv, D] -> [n, Hq, D] by the path the layer asks for."""
    windowed = bool(window) and window < k.shape[0]
    if not softcap and sinks is None and not windowed:
        o = prompt_kernel.causal(q, k, v, scale)
        if o is not None:
            return o
    # [1, H, n, D] views: SDPA's fused (flash) kernels want a batch dimension; without one
    # the CPU falls back to the unfused math path, ~6x slower on a 1,100-token prompt
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
    if softcap or sinks is not None:
        o = explicit_attention(qs[0], ks[0], vs[0], scale, window, softcap, sinks)
    elif windowed:
        o = windowed_attention(qs, ks, vs, scale, window)[0]
    else:
        o = causal_attention(qs, ks, vs, scale)[0]
    return o.transpose(0, 1)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[m] query and [t] key positions -> [m, t] bool: causal, and q - k < window where set."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window) if window else diff >= 0


def _key_range(p: int, a: int, b: int, window: int) -> tuple[int, int]:
    """Keys queries a..b-1 (at positions p + a .. p + b - 1) may reach."""
    return (max(0, p + a - window + 1) if window else 0), p + b


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       window: int) -> torch.Tensor:
    """q: [1, Hq, n, D], k/v: [1, Hkv, p + n, D] -> [1, Hq, n, D], query i at position p + i
    attending keys p + i - window < j <= p + i."""
    n, total = q.shape[2], k.shape[2]
    p = total - n
    block = min(n, max(window, _MIN_BLOCK))
    out = torch.empty_like(q)
    for a in range(0, n, block):
        b = min(n, a + block)
        lo, hi = _key_range(p, a, b, window)
        mask = _mask(torch.arange(p + a, p + b, device=q.device), torch.arange(lo, hi, device=q.device), window)
        out[:, :, a:b] = _sdpa(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], mask, scale)
    return out


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                       softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, n, D], k/v: [Hkv, p + n, D] -> [Hq, n, D] in q's dtype, computed in float32:
    scores * scale, then cap * tanh(s / cap), the causal (and window) mask, softmax over the keys
    and the head's sink logit (which takes probability but gives no value), times V."""
    hq, n, d = q.shape
    hkv, total = k.shape[0], k.shape[1]
    rep, p = hq // hkv, total - n
    # a block of m <= window queries reaches at most m + window - 1 < 2 window keys
    reach = min(total, 2 * window) if window else total
    block = max(1, min(n, window or n, _EXPLICIT_BYTES // (4 * hq * reach)))
    out = torch.empty_like(q)
    sink = None if sinks is None else sinks.float().view(hkv, rep, 1, 1)
    for a in range(0, n, block):
        b = min(n, a + block)
        lo, hi = _key_range(p, a, b, window)
        qb = q[:, a:b].float().view(hkv, rep, b - a, d)                     # [Hkv, rep, m, D]
        kb, vb = k[:, lo:hi].float()[:, None], v[:, lo:hi].float()[:, None]  # [Hkv, 1, t, D]
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale                   # [Hkv, rep, m, t]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        mask = _mask(torch.arange(p + a, p + b, device=q.device), torch.arange(lo, hi, device=q.device), window)
        s = s.masked_fill(~mask, float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.expand(hkv, rep, b - a, 1)], dim=-1)
        probs = torch.softmax(s, dim=-1)
        if sink is not None:
            probs = probs[..., :-1]
        out[:, a:b] = torch.matmul(probs, vb).reshape(hq, b - a, d).to(q.dtype)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [1, Hq, n, D], k/v: [1, Hkv, p + n, D] -> causal attention [1, Hq, n, D], query i at
    position p + i; grouped queries share their K/V head (SDPA's enable_gqa where this torch has
    it, else repeated K/V)."""
    n, total = q.shape[2], k.shape[2]
    mask = None
    if total != n:        # a chunk after earlier ones: the causal mask aligned to the last key
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    return _sdpa(q, k, v, mask, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA with a boolean mask, or causal where mask is None (q and k the same length)."""
    global _sdpa_gqa
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
