"""The int8 KV store's arithmetic (csrc/avx512/quant.h) repeated in numpy, the three float64
references and the error bound the store's decode attention is held to; check_seq checks an output
against all three. Used by tests/int8_cases.py and tests/test_int8_kernel*.py (the canary test that
the build has the modelled arithmetic is in tests/test_int8_kernel.py).

The arithmetic (quant.h; modelled below, with a canary test that the build has it): keys and
queries are turned by H, a block-diagonal orthonormal Hadamard matrix (blocks of B = the largest
power of two dividing Dp, <= 128; Dp = D rounded up to 16), computed in float32, so k' = H k and
q' = H q with q'.k' = q.k. The store keeps k' and v as int8 with one fp32 scale per (token, kv head)
each: x = s_x * xq, s_x = amax/127, xq = rint(x * 127/amax) in [-127, 127]. Per call the turned
query of each head is quantized with scale s_q = amax/127 in two int8 parts, q^' = s_q (qh + ql/254)
(half step QSTEP = 1/508; one part would be 1/2); the scores are integer dot products times
s_q s_k_t c (c = the softmax scale, 1/sqrt(D)); the PV product takes each page's (32 tokens, one
head) weights w_t = p_t * s_v_t in steps of wmax/127, two 7-bit parts ph + pl/127 (half step
WSTEP = 1/254; one part would be 1/2).

Two references, both float64 numpy, both with the original query q:
  (1) attention over the ORIGINAL k, v (what fp32 KV would give):       o   = sum_t pi_t v_t
  (2) attention over the DEQUANTIZED keys and values, k^ = H^T k^' and v^ (numpy repeats the
      store's float32 rotation and quantization bit for bit): isolates the query and page-weight
      quantization;                                                       o'  = sum_t pi'_t v^_t
and a third check: reference (2) with the kernel's own query q^' too (its scores exactly, up to fp32).

The bound, per output element (query head j, dim d), reference (1):
  scores. q.k - q^'.k^' = (q' - q^').k^' + q'.(k' - k^') with, elementwise in the turned basis,
        |q' - q^'| <= dq = s_q (QSTEP + 3e-5) + rho_q,   |k'_t - k^'_t| <= dk_t = s_k_t (1/2 + 3e-5) + rho_k_t
    (3e-5 of a step: the float32 rounding of 127/amax and of x * inv moves x * inv off x / s_x by
    <= 127 * 3 * 2^-24; rho_x = (log2 B + 2) 2^-24 max_block ||x_block||_1 / sqrt(B) bounds the
    float32 rotation's error), so the score error in natural-log units is at most
        E_t = c (dk_t ||q'||_1 + dq ||k^'_t||_1) + e32_t
    (without rotation and with one query part: E_t = c (s_k_t/2 ||q||_1 + s_q/2 ||k^_t||_1) + slack);
    e32_t = 1e-6 (|s_t| + max|s| + 2 max E + 16) covers the fp32 scores, the polynomial exp2, the
    online-softmax rescales and the chunk merge, each a few 2^-24 relative.
  weights. pihat_t / pi_t = e^{d_t} / sum_u pi_u e^{d_u} with |d_t| <= E_t, and by Cauchy-Schwarz
    1 / sum_u pi_u e^{-E_u} <= sum_u pi_u e^{E_u} =: e^{Ebar}, so with r_t = e^{E_t + Ebar}
    (<= e^{2E}, E = max_t E_t):   |pihat_t - pi_t| <= pi_t (r_t - 1),  pihat_t <= pi_t r_t.
  o^ - o = sum_t (pihat_t - pi_t)(v_t - o)                 (sum pihat = sum pi = 1)
         + sum_t pihat_t (v^_t - v_t)                       (V rounding: |v^ - v| <= s_v (1/2 + 3e-5))
         + (1/l) sum_t delta_t vq_t                         (page weights: |delta_t| <= wmax/127 (WSTEP + 3e-5))
  so |o^[d] - o[d]| <= sum_t pi_t (r_t - 1) |v_t[d] - o[d]|
                     + sum_t pi_t r_t s_v_t (1/2 + 3e-5)
                     + sum_pages max_{t in page}(pi_t r_t s_v_t) / 127 (WSTEP + 3e-5) sum_{t in page} |vq_t[d]|
                     + 4e-5 max_t |v_t|          (fp32 sums in the kernel: every term carries a relative
                                                  error <= (70 + T/512) 2^-24 < 1e-5 for T <= 16k, and
                                                  so does l; twice that, doubled)
  (one 7-bit weight part: the page term is max(pi_t r_t s_v_t)/254 sum |vq_t[d]|, up to the 3e-5).
Reference (2) has the same shape with s'_t = c q'.k^'_t, E'_t = c dq ||k^'_t||_1 + e32_t (no K
error), v^ in place of v and no V-rounding term: a tighter bound. The third: E''_t = e32_t, the
page-weight term and fp32 only.

Every output element is checked against all three bounds; the observed max error / bound and the mean
absolute error are printed (pytest -s) and, for gaussian data, the mean error is asserted to be below
half a V quantization step s_v (reference 1) and below 2 max(QSTEP, WSTEP) s_v (reference 2: 1/254
of a step with two parts each, one step with one part), so the worst-case bound is not all that is
checked.
"""
from __future__ import annotations

import math

import numpy as np

PT = 32                    # tokens per page
F32 = np.float32

# ---------------------------------------------------------------------------------------------
# the store's arithmetic, repeated in numpy (float32 where quant.h computes in float32)

Q_PARTS = 2                       # the query in two int8 parts, q^' = s_q (qh + ql / 254)
W_PARTS = 2                       # the page weights in two 7-bit parts, w^ = wmax/127 (ph + pl / 127)
QSTEP = {1: 1 / 2, 2: 1 / 508}[Q_PARTS]      # max |q' - q^'| / s_q (exact arithmetic)
WSTEP = {1: 1 / 2, 2: 1 / 254}[W_PARTS]      # max |w - w^| / (wmax / 127)
U = 2.0**-24


def pad(x, Dp):
    x = np.asarray(x, F32)
    return np.concatenate([x, np.zeros(x.shape[:-1] + (Dp - x.shape[-1],), F32)], axis=-1)


def hadamard(x, dtype=F32):
    """quant.h hadamard: blocks of B (the largest power of two dividing the padded dim, <= 128)
    times H_B / sqrt(B), the same butterflies in the same order (float32: the store's bits;
    float64: the exact rotation, which is symmetric and its own inverse)."""
    y = np.array(x, dtype)
    n = y.shape[-1]
    B = min(n & -n, 128)
    z = y.reshape(y.shape[:-1] + (n // B, B))
    h = 1
    while h < B:
        w = z.reshape(z.shape[:-1] + (B // (2 * h), 2, h))
        a = w[..., 0, :].copy()
        w[..., 0, :] = a + w[..., 1, :]
        w[..., 1, :] = a - w[..., 1, :]
        h *= 2
    z *= dtype(1) / np.sqrt(dtype(B))
    return y


def rot_err(x):
    """Bound on |fl32(H x) - H x| per row: (log2 B + 2) 2^-24 max_block ||x_block||_1 / sqrt(B)."""
    x = np.abs(np.asarray(x, np.float64))
    n = x.shape[-1]
    B = min(n & -n, 128)
    return (math.log2(B) + 2) * U * x.reshape(x.shape[:-1] + (n // B, B)).sum(-1).max(-1) / math.sqrt(B)


def quant_rows(x):
    """x [..., n] float32 -> (xq float64 integers, scale [...] float64 of the fp32 scale): amax/127
    and 127/amax in float32, rint(x * inv) clipped to +-127 (rows with inf/NaN: scale NaN)."""
    x = np.asarray(x, F32)
    amax = np.abs(x).max(axis=-1)
    amax = np.where(np.isfinite(x).all(axis=-1), amax, F32(np.nan)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
        y = (x * inv[..., None]).astype(F32)
    y = np.clip(np.where(np.isnan(y), F32(0), y), F32(-127), F32(127))
    return np.rint(y).astype(np.float64), (amax / F32(127)).astype(F32).astype(np.float64)


def quant_query(q, Dp):
    """The kernel's query (quant_query) -> (q^' [..., Dp] float64 in the turned basis, s_q): one part
    s_q qh, or two s_q (qh + ql / 254), qh = rint(y), ql = rint((y - qh) 254), y = H q * 127/amax."""
    x = hadamard(pad(q, Dp))
    hi, sq = quant_rows(x)
    if Q_PARTS == 1:
        return hi * sq[..., None], sq
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    y = (x * inv[..., None]).astype(F32)
    lo = np.rint(np.clip(((y - hi.astype(F32)).astype(F32) * F32(254)).astype(F32), -127, 127))
    return (hi + lo / 254) * sq[..., None], sq


def _softmax(s):
    p = np.exp(s - s.max())
    return p / p.sum()


def _bound(s, E, vals, sv, vq, vmax, v_term):
    """The reference output o = softmax(s) @ vals and the elementwise bound of the docstring."""
    pi = _softmax(s)
    o = pi @ vals
    Ebar = math.log(float(pi @ np.exp(E)))
    r = np.exp(E + Ebar)
    B = (pi * (r - 1)) @ np.abs(vals - o)
    if v_term:
        B = B + float((pi * r * sv).sum()) * (1 / 2 + 3e-5)
    T, D = vq.shape
    npg = -(-T // PT)
    a = np.zeros(npg * PT)
    a[:T] = pi * r * sv
    aq = np.zeros((npg * PT, D))
    aq[:T] = np.abs(vq)
    B = B + (a.reshape(npg, PT).max(axis=1) / 127 * (WSTEP + 3e-5)) @ aq.reshape(npg, PT, D).sum(axis=1)
    return o, B + 4e-5 * vmax


def check_seq(o, q, k, v, st, label, stats=None):
    """o [Hq, D] from store st; q [Hq, D], k, v [T, Hkv, D] float32 (the values appended) -> the
    three references and their bounds (module docstring), asserted elementwise."""
    c = st.scale
    q, k, v = (np.asarray(a, F32) for a in (q, k, v))
    Hq, D = q.shape
    T, Hkv, _ = k.shape
    Dp = -(-D // 16) * 16
    g = Hq // Hkv
    kq, sk = quant_rows(hadamard(pad(k, Dp)))                 # the stored keys, turned
    vq, sv = quant_rows(v)
    khat, vhat = kq * sk[..., None], vq * sv[..., None]       # k^' (turned basis), v^
    qhat, sq = quant_query(q, Dp)                             # the kernel's query, turned
    qrot = hadamard(pad(q, Dp), np.float64)                   # q' = H q exactly
    krot = hadamard(pad(k, Dp), np.float64)                   # k' = H k exactly
    rho_q, rho_k = rot_err(pad(q, Dp)), rot_err(pad(k, Dp))   # fp32 rotation errors [Hq], [T, Hkv]
    v64 = v.astype(np.float64)
    kh1 = np.abs(khat).sum(axis=2)                            # [T, Hkv] ||k^'_t||_1
    got = np.asarray(o, np.float64)
    out = np.zeros((6, Hq, D))
    for j in range(Hq):
        h = j // g
        q1 = np.abs(qrot[j]).sum()
        dq = sq[j] * (QSTEP + 3e-5) + rho_q[j]                # |q' - q^'| elementwise
        dk = sk[:, h] * (1 / 2 + 3e-5) + rho_k[:, h]           # |k'_t - k^'_t| elementwise
        vmax = float(np.abs(v64[:, h]).max())
        s1 = c * (krot[:, h] @ qrot[j])                       # = c q . k_t
        E1 = c * (dk * q1 + dq * kh1[:, h])
        E1 = E1 + 1e-6 * (np.abs(s1) + np.abs(s1).max() + 2 * E1.max() + 16)
        o1, B1 = _bound(s1, E1, v64[:, h], sv[:, h], vq[:, h], vmax, True)
        s2 = c * (khat[:, h] @ qrot[j])
        E2 = c * dq * kh1[:, h]
        E2 = E2 + 1e-6 * (np.abs(s2) + np.abs(s2).max() + 2 * E2.max() + 16)
        o2, B2 = _bound(s2, E2, vhat[:, h], sv[:, h], vq[:, h], vmax, False)
        s3 = c * (khat[:, h] @ qhat[j])
        E3 = 1e-6 * (np.abs(s3) + np.abs(s3).max() + 16)
        o3, B3 = _bound(s3, E3, vhat[:, h], sv[:, h], vq[:, h], vmax, False)
        out[:, j] = np.abs(got[j] - o1), np.abs(got[j] - o2), np.abs(got[j] - o3), B1, B2, B3
    e1, e2, e3, B1, B2, B3 = out
    assert np.isfinite(got).all(), f"{label}: non-finite output"
    assert (e1 <= B1).all(), (f"{label}: |o - ref(original)| {e1.max():.4g} > bound "
                              f"(worst ratio {(e1 / B1).max():.3g})")
    assert (e2 <= B2).all(), (f"{label}: |o - ref(dequantized)| {e2.max():.4g} > bound "
                              f"(worst ratio {(e2 / B2).max():.3g})")
    assert (e3 <= B3).all(), (f"{label}: |o - ref(dequantized, kernel's q^)| {e3.max():.4g} > bound "
                              f"(worst ratio {(e3 / B3).max():.3g})")
    if stats is not None:
        stats.append({"T": T, "r1": (e1 / B1).max(), "r2": (e2 / B2).max(), "r3": (e3 / B3).max(), "max1": e1.max(),
                      "mean1": e1.mean(), "mean2": e2.mean(), "mean3": e3.mean(), "B1": B1.max(), "B2": B2.max(),
                      "B3": B3.max(), "step": sv.mean()})
    return e1, e2, e3, B1, B2, B3


def report(label, stats):
    """Print the margins (pytest -s shows them)."""
    for s in stats:
        print(f"{label} T={s['T']:>5}: max|err| {s['max1']:.2e} (orig) max err/bound {s['r1']:.3f} (orig) "
              f"{s['r2']:.3f} (dequant) {s['r3']:.3f} (q^); bound max {s['B1']:.1e} / {s['B2']:.1e} / {s['B3']:.1e}; "
              f"mean|err| {s['mean1']:.1e} / {s['mean2']:.1e} / {s['mean3']:.1e}, V step {s['step']:.1e}")
