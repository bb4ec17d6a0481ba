"""Paged decode attention as Triton kernels: the device KV tier's attention on a CUDA S-worker.

One program per (row, KV head, KV split) reads the split's tokens of that head once, in tiles of
TILE_BYTES (four pages of 16 tokens at D = 128 in bf16, or part of a bigger page: each token finds
its page through the block table), pipelined into shared memory, and serves the G query heads
that share the head together (GQA): the scores and the weighted sum are two `tl.dot`s over a
[G_PAD, D] query tile, G padded to 16 rows (the smallest MMA tile), so the work per byte read is
a few MMA instructions and the kernel streams at the card's read bandwidth. Softmax is online (running max and sum, base 2)
with float32 accumulation. Where the rows x KV heads alone cannot fill the card (few long
sequences) the tokens split into chunks (flash-decoding): each writes its unnormalized sum,
max and denominator, and a second small kernel merges them per (row, query head).

Imported only when triton is present; tests run it on the CPU under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # a constexpr: kernels read only those globals
MAX_HEAD_DIM = 256                  # a [16, D] tile at the least; wider heads take the torch path
MAX_SPLITS = 64                     # the merge kernel holds [splits, D] partial sums in registers
PROGRAMS_PER_SM = 4                 # split until rows x KV heads x splits reaches this many per SM
TILE_BYTES = 16384                  # one K (or V) tile per loop iteration: 64 bf16 tokens at D = 128


@triton.jit
def _tanh(x):
    # odd and overflow-free: e = e^(-2|x|) in (0, 1]
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _mma(a, b, IEEE: tl.constexpr):
    # float32 tiles as exact products (not TF32); bf16/fp16 tiles the MMA's own way
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, sinks_ptr, out_ptr, pacc_ptr, pm_ptr, pl_ptr,
        scale, softcap, window, max_pages, chunk, splits,
        stride_qn, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
        stride_btn, stride_on, stride_oh,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr,
        DOT_FP32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_heads = tl.num_programs(1) * G

    # keys [lo, hi): the window's, never past what the block table holds
    hi = tl.minimum(tl.load(lens_ptr + row), max_pages * PAGE)
    lo = tl.where(window > 0, tl.maximum(hi - window, 0), 0)
    start = (lo // BLOCK_T) * BLOCK_T + split * chunk         # from the block of the window's first key
    end = tl.minimum(start + chunk, hi)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    t_in = tl.arange(0, BLOCK_T)
    g_ok = g < G
    d_ok = d < D
    heads = kvh * G + g                                        # [G_PAD] query heads of this KV head
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(k_ptr.dtype.element_ty)   # [G_PAD, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)         # running max of the scores (log2 units)
    l_i = tl.zeros([G_PAD], tl.float32)                        # running sum of 2^(s - m)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)                 # running sum of 2^(s - m) v
    bt_row = bt_ptr + row * stride_btn
    for t0 in range(start, end, BLOCK_T):
        t = t0 + t_in                                          # [BLOCK_T] token positions
        live = (t >= lo) & (t < end)
        page = tl.load(bt_row + t // PAGE, mask=t < end, other=0).to(tl.int64)
        slot = t % PAGE
        tile_ok = live[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (page * stride_kp + slot * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                    mask=tile_ok, other=0.0)                   # [BLOCK_T, D_PAD]
        if DOT_FP32:
            k = k.to(tl.float32)
        s = _mma(q, tl.trans(k), IEEE) * scale   # [G_PAD, BLOCK_T]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(live[None, :], s * LOG2E, float("-inf"))
        # every block in the loop holds a live token, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (page * stride_vp + slot * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=tile_ok, other=0.0)                   # [BLOCK_T, D_PAD]
        pv = p.to(v.dtype)                                     # the weights rounded as the MMA takes them
        if DOT_FP32:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + _mma(pv, v, IEEE)
        m_i = m_new

    if not SPLIT:
        if HAS_SINKS:
            # the sink's column joins the denominator; the larger of max and sink is the reference
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0) * LOG2E
            big = tl.maximum(m_i, sink)
            f = tl.exp2(m_i - big)
            o = acc * (f / (l_i * f + tl.exp2(sink - big)))[:, None]
        else:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]    # a row with no keys gives 0
        tl.store(out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # partials [n, Hq, splits(, D)]: an empty split leaves m = -inf, l = 0, acc = 0
        at = (row * n_heads + heads) * splits + split         # [G_PAD]
        tl.store(pm_ptr + at, m_i, mask=g_ok)
        tl.store(pl_ptr + at, l_i, mask=g_ok)
        tl.store(pacc_ptr + at[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(pacc_ptr, pm_ptr, pl_ptr, sinks_ptr, out_ptr, splits, stride_on, stride_oh,
                         S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         HAS_SINKS: tl.constexpr):
    # one (row, query head): out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s [+ 2^(sink - M)])
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    n_heads = tl.num_programs(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < splits
    d_ok = d < D
    at = (row * n_heads + head) * splits + s
    m = tl.load(pm_ptr + at, mask=s_ok, other=float("-inf"))
    ell = tl.load(pl_ptr + at, mask=s_ok, other=0.0)
    big = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        big = tl.maximum(big, sink)
    big = tl.where(big == float("-inf"), 0.0, big)            # no keys at all: every weight is 0
    w = tl.exp2(m - big)                                       # [S_PAD], 0 for empty splits
    denom = tl.sum(w * ell, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - big)
    acc = tl.load(pacc_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + row * stride_on + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def program_slots(device: torch.device) -> int:
    """Programs that keep the device's memory system busy: PROGRAMS_PER_SM per SM; a CPU (the
    interpreter) counts as 4 SMs so that the tests see splits at small sizes."""
    if device.type == "cuda":
        return PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return PROGRAMS_PER_SM * 4


def block_tokens(head_dim: int, elem_bytes: int) -> int:
    """Tokens per loop iteration: a TILE_BYTES tile of K (several pages of 16, or part of a big
    page: each token finds its page itself), at least 16 (the MMA's N)."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    return max(16, TILE_BYTES // (d_pad * elem_bytes))


def plan_splits(n: int, kv_heads: int, span: int, unit: int, slots: int) -> tuple[int, int]:
    """(splits, tokens per split) for rows whose keys span at most `span` tokens from their first
    block: one split while n * kv_heads fills `slots`, else enough to, each a multiple of `unit`
    (whole blocks and whole pages) and at least 2 units."""
    span = max(span, 1)
    programs = n * kv_heads
    if programs >= slots or span <= 2 * unit:
        return 1, triton.cdiv(span, unit) * unit
    want = min(MAX_SPLITS, triton.cdiv(slots, programs), triton.cdiv(span, 2 * unit))
    chunk = triton.cdiv(triton.cdiv(span, want), unit) * unit
    return triton.cdiv(span, chunk), chunk


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int, softcap: float, sinks: torch.Tensor | None,
                 out: torch.Tensor, max_seq_len: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """The Triton path of paged_attention.paged_decode_attention (arguments checked there).
    q: [n, Hq, D]; caches: [pages, P, Hkv, D]; block_tables: [n, max_pages] int32; seq_lens: [n]
    int32; sinks: [Hq] float32 or None; out: [n, Hq, D]. No host sync: the split count comes from
    the block table's width (or max_seq_len), never from seq_lens' values."""
    n, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = hq // hkv
    max_pages = block_tables.shape[1]
    if n == 0:
        return out
    block_t = block_tokens(d, k_cache.element_size())
    unit = max(block_t, page)                                  # both powers of two: a multiple of each
    longest = min(max_pages * page, max_seq_len if max_seq_len is not None else max_pages * page)
    # keys from the window's first block on: at most the window plus the block it starts inside
    span = min(longest, window + block_t) if window > 0 else longest
    if num_splits is None:
        splits, chunk = plan_splits(n, hkv, span, unit, program_slots(q.device))
    else:
        chunk = triton.cdiv(triton.cdiv(max(span, 1), max(1, min(num_splits, MAX_SPLITS))), unit) * unit
        splits = triton.cdiv(max(span, 1), chunk)
    d_pad = max(16, triton.next_power_of_2(d))
    g_pad = max(16, triton.next_power_of_2(g))
    # the interpreter's tl.dot multiplies bf16/fp16 tiles' raw bits (Triton 3.9): on the CPU the
    # tiles go to float32 first, after the same roundings (results then equal within the MMA's sums)
    dot_fp32 = q.device.type != "cuda"
    ieee = k_cache.dtype == torch.float32 or dot_fp32
    sinks_arg = sinks if sinks is not None else q
    if splits > 1:
        pacc = torch.empty(n, hq, splits, d, dtype=torch.float32, device=q.device)
        pm = torch.empty(n, hq, splits, dtype=torch.float32, device=q.device)
        pl = torch.empty(n, hq, splits, dtype=torch.float32, device=q.device)
    else:
        pacc = pm = pl = out                                   # unused
    _paged_decode_kernel[(n, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, sinks_arg, out, pacc, pm, pl,
        float(scale), float(softcap), int(window), max_pages, chunk, splits,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=g, G_PAD=g_pad, D=d, D_PAD=d_pad, PAGE=page, BLOCK_T=block_t, SPLIT=splits > 1,
        HAS_SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None, IEEE=ieee, DOT_FP32=dot_fp32,
        num_warps=4, num_stages=3)
    if splits > 1:
        _merge_splits_kernel[(n, hq)](pacc, pm, pl, sinks_arg, out, splits, out.stride(0), out.stride(1),
                                      S_PAD=triton.next_power_of_2(splits), D=d, D_PAD=d_pad,
                                      HAS_SINKS=sinks is not None, num_warps=4)
    return out


