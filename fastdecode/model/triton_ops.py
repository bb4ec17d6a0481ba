"""The S-part's elementwise passes fused into single Triton kernels (CUDA S-worker, bf16/fp16).

Unfused, RMSNorm in float32 is ~7 passes over the rows, RoPE on q and k ~8, the packing of
q|k|v for the wire one more, SiLU*up two: at B = 4096 on an H100 they cost about as much as the
layer's GEMMs. Each kernel here is one pass and rounds exactly where the torch code in ops.py
rounds (which is where HF transformers rounds), so the two paths agree to the last bit except
where float32 contraction/rsqrt/exp differ by an ulp before the final rounding.

Imported only when triton is present; tests run these kernels on the CPU under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_FUSED_HIDDEN = 16384      # one row per program: wider rows take the torch path


# ----------------------------------------------------------------------------- RMSNorm (+ residual)

@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    # one row: [x + delta ->] sum (act dtype), y = w * (float(sum) * rsqrt(mean(sum^2) + eps)).to(act)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * H + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    xn = (xf * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * xn.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * H + cols, y, mask=mask)


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [n, h] contiguous -> (x + delta, RMSNorm(x + delta)) both [n, h] in x's dtype
    (without delta the first is x itself)."""
    n, h = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else x
    block = triton.next_power_of_2(h)
    if n:
        _rms_norm_kernel[(n,)](x, delta if delta is not None else x, weight, out, total, h, eps,
                               HAS_DELTA=delta is not None, BLOCK=block, num_warps=_row_warps(block))
    return total, out


# ----------------------------------------------------------------------------- SiLU(gate) * up

@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    # gu: [n, 2I] = gate | up -> out [n, I]; silu rounded to the act dtype before the product, as torch
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [n, 2I] contiguous -> silu(gate) * up: [n, I]."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out


# ----------------------------------------------------------------------------- RoPE + wire packing

@triton.jit
def _rotate_store(src, dst, cos1, sin1, cos2, sin2, heads, D: tl.constexpr, HALF: tl.constexpr,
                  HALF_P2: tl.constexpr, HEADS_P2: tl.constexpr):
    # src/dst: [heads, D] rows of one token; out = x * cos + rotate_half(x) * sin (HF's form)
    h = tl.arange(0, HEADS_P2)
    c = tl.arange(0, HALF_P2)
    mask = (h < heads)[:, None] & (c < HALF)[None, :]
    idx = h[:, None] * D + c[None, :]
    x1 = tl.load(src + idx, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + idx + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos1[None, :] + (-x2) * sin1[None, :]
    o2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    # rounded to the activation dtype first, as the torch code does before any wire cast
    tl.store(dst + idx, o1.to(src.dtype.element_ty).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + idx + HALF, o2.to(src.dtype.element_ty).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_pack_kernel(qkv_ptr, cos_ptr, sin_ptr, off_ptr, out_ptr,
                      HQ, HKV, D: tl.constexpr, HALF_P2: tl.constexpr, HQ_P2: tl.constexpr,
                      HKV_P2: tl.constexpr, V_P2: tl.constexpr):
    # one token row of qkv [(HQ + 2 HKV) * D]: rotate q and k, copy v, each to its wire offset
    row = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    c = tl.arange(0, HALF_P2)
    cm = c < HALF
    cos1 = tl.load(cos_ptr + row * D + c, mask=cm, other=0.0)
    cos2 = tl.load(cos_ptr + row * D + HALF + c, mask=cm, other=0.0)
    sin1 = tl.load(sin_ptr + row * D + c, mask=cm, other=0.0)
    sin2 = tl.load(sin_ptr + row * D + HALF + c, mask=cm, other=0.0)
    src = qkv_ptr + row * (HQ + 2 * HKV) * D
    q_off = tl.load(off_ptr + row * 3)
    k_off = tl.load(off_ptr + row * 3 + 1)
    v_off = tl.load(off_ptr + row * 3 + 2)
    _rotate_store(src, out_ptr + q_off, cos1, sin1, cos2, sin2, HQ, D, HALF, HALF_P2, HQ_P2)
    _rotate_store(src + HQ * D, out_ptr + k_off, cos1, sin1, cos2, sin2, HKV, D, HALF, HALF_P2, HKV_P2)
    v = tl.arange(0, V_P2)
    vm = v < HKV * D
    vals = tl.load(src + (HQ + HKV) * D + v, mask=vm, other=0.0)
    tl.store(out_ptr + v_off + v, vals.to(out_ptr.dtype.element_ty), mask=vm)


def rope_pack(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offsets: torch.Tensor,
              out: torch.Tensor, hq: int, hkv: int, d: int) -> None:
    """qkv: [n, (Hq + 2 Hkv) D] contiguous; cos/sin: [n, D] float32; offsets: [n, 3] int64 element
    offsets of each row's q, k, v in `out` (the wire layout) -> out filled (q, k rotated)."""
    n = qkv.shape[0]
    if not n:
        return
    p2 = triton.next_power_of_2
    warps = 4 if hq * d <= 4096 else 8
    _rope_pack_kernel[(n,)](qkv, cos, sin, offsets, out, hq, hkv, D=d, HALF_P2=p2(d // 2),
                            HQ_P2=p2(hq), HKV_P2=p2(hkv), V_P2=p2(hkv * d), num_warps=warps)


# ----------------------------------------------------------------------------- fp8 rows (activations)

@triton.jit
def _quantize_fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, amax_ub, min_amax, HAS_UB: tl.constexpr,
                              BLOCK: tl.constexpr):
    # one row of x [n, K]: s = max(min(max|x|, ub), min_amax) / 448, q = clamp(x / s, +-448) -> q's dtype
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * K
    peak = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    amax = tl.max(peak, axis=0)
    if HAS_UB:
        amax = tl.minimum(amax, amax_ub)
    # divisions rounded as torch's (div_rn), so q matches the torch code's before the e4m3 cast
    s = tl.math.div_rn(tl.maximum(amax, min_amax), 448.0)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, s), -448.0, 448.0)
        tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(s_ptr + row, s)


def quantize_fp8_rows(x: torch.Tensor, amax_ub: float | None = None,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n, K] contiguous -> (q [n, K] float8_e4m3fn, scales [n] float32): one scale per row,
    as fp8.quantize_rows. `out` may be a float32 [n, K] buffer instead (tests under the
    interpreter, whose float32 -> e4m3 cast is not the GPU's: they cast the values themselves)."""
    from fastdecode.model.fp8_format import E4M3, E4M3_MAX, MIN_AMAX
    assert E4M3_MAX == 448.0
    n, k = x.shape
    q = out if out is not None else torch.empty(n, k, dtype=E4M3, device=x.device)
    s = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        _quantize_fp8_rows_kernel[(n,)](x, q, s, k, float(amax_ub or 0.0), MIN_AMAX, HAS_UB=amax_ub is not None,
                                        BLOCK=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q, s
