"""Decode attention over a paged KV cache in the S-worker's own memory (the device KV tier).

A layer's cache is two tensors [num_pages, page_tokens, Hkv, D] (K and V); a sequence owns pages
in any order, listed by its row of the block table. Each decode row has one query per head and
attends the keys [0, len) of its sequence, the new token's own included, or with a sliding
window W only [max(0, len - W), len); with the R-workers' variants (docs/models.md, "Attention
variants on the R-workers"): a logit soft-cap `cap * tanh(s / cap)` on every score
s = q.k * scale, and per-query-head sinks in the softmax's denominator only.

Two paths behind one function: Triton kernels (paged_attention_triton.py) for CUDA tensors, and
torch code (the pages gathered into a padded [n, T, Hkv, D], softmax in float32) anywhere else.
FASTDECODE_PAGED_ATTN=torch|triton forces one (tests, A/B; triton on CPU tensors needs
TRITON_INTERPRET=1 set before triton is imported).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

ENV = "FASTDECODE_PAGED_ATTN"
BACKENDS = ("auto", "torch", "triton")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _triton_path():
    try:
        from fastdecode.rpart import paged_attention_triton
    except Exception:      # noqa: BLE001 - no triton (CPU installs) or a broken one: torch code
        return None
    return paged_attention_triton


def backend_for(q: torch.Tensor, head_dim: int) -> str:
    """'triton' or 'torch' for these tensors: Triton for CUDA tensors where it is importable and
    the head fits a tile, unless FASTDECODE_PAGED_ATTN forces one."""
    flag = os.environ.get(ENV, "").strip().lower() or "auto"
    if flag not in BACKENDS:
        raise ValueError(f"{ENV}={flag!r}: expected one of {', '.join(BACKENDS)}")
    if flag == "torch":
        return "torch"
    tri = _triton_path()
    if flag == "triton":
        if tri is None:
            raise RuntimeError(f"{ENV}=triton: triton is not importable here")
        if head_dim > tri.MAX_HEAD_DIM:
            raise ValueError(f"{ENV}=triton: head dim {head_dim} is over the kernel's {tri.MAX_HEAD_DIM}")
        return "triton"
    return "triton" if q.is_cuda and tri is not None and head_dim <= tri.MAX_HEAD_DIM else "torch"


def _check(q, k_cache, v_cache, block_tables, seq_lens, window, softcap, sinks, out) -> None:
    """Shapes, dtypes and devices only: nothing here reads device memory (no sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [n, Hq, D], got shape {tuple(q.shape)}")
    n, hq, d = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be the same [pages, page_tokens, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, page, hkv, dk = k_cache.shape
    if dk != d or hkv == 0 or hq % hkv:
        raise ValueError(f"q's {hq} heads x {d} do not fit the cache's {hkv} KV heads x {dk} "
                         "(Hq must be a multiple of Hkv, head dims equal)")
    if page <= 0 or page & (page - 1):
        raise ValueError(f"page_tokens must be a power of two, got {page}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q's dtype {q.dtype} is not one of bfloat16, float16, float32")
    if k_cache.dtype not in (q.dtype, torch.float32) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the caches' dtypes ({k_cache.dtype}, {v_cache.dtype}) must both be q's ({q.dtype}) "
                         "or float32")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along the head dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != n or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [n={n}, max_pages] int32, got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if seq_lens.shape != (n,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [n={n}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window ({window}) and softcap ({softcap}) must be >= 0 (0: none)")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be [Hq={hq}], got {tuple(sinks.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, contiguous along the head dim; got "
                         f"{tuple(out.shape)} {out.dtype}")
    tensors = [k_cache, v_cache, block_tables, seq_lens] + [t for t in (sinks, out) if t is not None]
    wrong = [t.device for t in tensors if t.device != q.device]
    if wrong:
        raise ValueError(f"every tensor must be on q's device {q.device}; one is on {wrong[0]}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           *, max_seq_len: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """One decode step's attention for n rows over a paged cache.

    q: [n, Hq, D] bf16/fp16/fp32, one query per row; query head h reads KV head h // (Hq / Hkv).
    k_cache, v_cache: [num_pages, page_tokens, Hkv, D] in q's dtype or float32, page_tokens a
        power of two, contiguous along D.
    block_tables: [n, max_pages] int32, row i's page ids in order; entries past its length are
        never read. seq_lens: [n] int32, keys per row (the new token's included), at most
        max_pages * page_tokens (the Triton path clamps to that instead of checking: no sync).
    scale: the softmax scale; window: keys per query (0: all); softcap: the logit cap (0: none);
    sinks: [Hq] natural-log sink logits or None; out: [n, Hq, D] in q's dtype to write, or None.
    max_seq_len: a bound the caller knows, at least every seq_len (default: the block table's width);
    num_splits: force the KV splits of the Triton path (default: from the device and the bound).
    Returns out [n, Hq, D] in q's dtype; a row with no keys gives zeros.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, window, softcap, sinks, out)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if sinks is not None:
        sinks = sinks.to(dtype=torch.float32).contiguous()
    if backend_for(q, q.shape[2]) == "triton":
        def unit_last(t):                                   # strided rows are fine; the last dim is read as one run
            return t if t.stride(-1) == 1 else t.contiguous()
        return _triton_path().paged_decode(unit_last(q), k_cache, v_cache, unit_last(block_tables),
                                           seq_lens.contiguous(), scale, window, softcap, sinks, out,
                                           max_seq_len=max_seq_len, num_splits=num_splits)
    out.copy_(paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks))
    return out


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: gather each row's pages into [n, T, Hkv, D] (T = the longest row, padded),
    mask, softmax in float32 (SDPA where no variant needs the scores). Syncs once (the longest
    row) and checks that every row fits its block table."""
    n, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = hq // hkv
    if n == 0:
        return torch.empty_like(q)
    lens = seq_lens.long()
    held = block_tables.shape[1] * page
    over = torch.nonzero(lens > held)
    if len(over):
        i = int(over[0, 0])
        raise ValueError(f"seq_lens[{i}] = {int(lens[i])} is more than block_tables row {i} holds "
                         f"({block_tables.shape[1]} pages of {page})")
    pages = max(1, -(-int(lens.max()) // page))
    # page ids past a row's length are garbage: page 0 stands in, its keys masked below
    owned = torch.arange(pages, device=q.device)[None, :] < ((lens + page - 1) // page)[:, None]   # [n, pages]
    ids = torch.where(owned, block_tables[:, :pages].long(), 0)
    k = k_cache[ids].reshape(n, pages * page, hkv, d).transpose(1, 2)       # [n, Hkv, T, D]
    v = v_cache[ids].reshape(n, pages * page, hkv, d).transpose(1, 2)
    pos = torch.arange(pages * page, device=q.device)[None, :]
    lo = (lens - window).clamp(min=0) if window > 0 else torch.zeros_like(lens)
    live = (pos >= lo[:, None]) & (pos < lens[:, None])                     # [n, T]
    # slots outside [lo, len) hold whatever the pages last held (NaN bits included): zeroed, as
    # a masked score's weight of 0 times NaN would still be NaN
    k.masked_fill_(~live[:, None, :, None], 0.0)                             # in place: the gathers are copies
    v.masked_fill_(~live[:, None, :, None], 0.0)
    qg = q.reshape(n, hkv, g, d)                                            # the G heads of a KV head as rows
    if softcap == 0 and sinks is None:
        o = F.scaled_dot_product_attention(qg.to(k.dtype), k, v, attn_mask=live[:, None, None, :], scale=scale)
    else:
        s = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale   # [n, Hkv, G, T]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~live[:, None, None, :], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float().reshape(1, hkv, g, 1).expand(n, hkv, g, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :pages * page]
        o = torch.matmul(p, v.float())
    o = o.masked_fill((lens == 0)[:, None, None, None], 0.0)              # no keys: 0, not NaN
    return o.reshape(n, hq, d).to(q.dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store m tokens' K and V: slots [m] int64 flat slot ids (page * page_tokens + offset), distinct;
    k, v: [m, Hkv, D] (cast to the cache's dtype). The caches' page and token dims must be
    contiguous with each other (a [pages * page_tokens, Hkv, D] view)."""
    if slots.dim() != 1 or k.shape != (slots.shape[0], *k_cache.shape[2:]) or v.shape != k.shape:
        raise ValueError(f"write_kv: slots [m] and k, v [m, Hkv, D] = [m, {k_cache.shape[2]}, {k_cache.shape[3]}] "
                         f"expected, got {tuple(slots.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for cache, new in ((k_cache, k), (v_cache, v)):
        try:
            flat = cache.view(-1, *cache.shape[2:])                          # [pages * page_tokens, Hkv, D]
        except RuntimeError as e:
            raise ValueError(f"write_kv: a cache of shape {tuple(cache.shape)} and strides {cache.stride()} "
                             "has no flat slot view") from e
        flat.index_copy_(0, slots.long(), new.to(cache.dtype))
