"""float64 numpy reference of decode attention, dtype rounding helpers and tolerances.

Used by the KVStore tests (tests/kvstore_cases.py) and bench/kernel/kernel_bench.py (correctness check
before timing).
"""
from __future__ import annotations

import numpy as np

# unit roundoff u = 2^-(significand bits): the largest relative error of one rounding to nearest
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_f32(x: np.ndarray) -> np.ndarray:
    """float32 as is; uint16 read as bf16 bits."""
    return bf16_bits_to_f32(x) if x.dtype == np.uint16 else np.asarray(x, np.float32)


def quantize(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """What the store holds for input x (float32 or bf16 bits), as float64."""
    x = as_f32(x)
    if kv_dtype == "bf16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64)
    if kv_dtype == "fp16":
        return x.astype(np.float16).astype(np.float64)
    return x.astype(np.float64)


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softcap: float | None = None,
                  sinks: np.ndarray | None = None) -> np.ndarray:
    """q [Hq, D]; k, v [T, Hkv, D] -> o [Hq, D] in float64 (query head h uses kv head h // (Hq/Hkv)).
    The attention variants (a sliding window: pass the window's tokens): softcap, scores s ->
    softcap tanh(s / softcap); sinks [Hq], one more softmax column per head (its logit) that adds
    to the denominator only."""
    q = as_f32(q).astype(np.float64) if q.dtype != np.float64 else q
    Hq, Hkv = q.shape[0], k.shape[1]
    g = Hq // Hkv
    kk = np.repeat(k.astype(np.float64), g, axis=1)          # [T, Hq, D]
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("hd,thd->ht", q, kk) * scale               # [Hq, T]
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if sinks is None:
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        return np.einsum("ht,thd->hd", p, vv)
    col = np.asarray(sinks, np.float64).reshape(Hq, 1)
    m = np.maximum(s.max(axis=1, keepdims=True), col)
    p = np.exp(s - m)
    return np.einsum("ht,thd->hd", p, vv) / (p.sum(axis=1, keepdims=True) + np.exp(col - m))


def tolerance(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, kv_dtype: str,
              softcap: float | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """Per query head bound on |o - o_ref| for o_ref computed from the UNROUNDED k, v (float64).

    Rounding v to the store dtype moves o by at most u*max|v| (o is a convex combination).
    Rounding k moves each score by at most ds = u*scale*sum_d|q_d k_d|; softmax moves its weights
    by at most 2*max|ds| in l1, which moves o by at most 2*max|ds|*max|v|. The fp32 arithmetic of
    the kernel adds the same two terms with u = 2^-24 times a small factor for the length of the
    dot products / sums (4*sqrt(D) + log2(T) + 8 roundings, generous against a worst case that
    never occurs in random data). The variants: the kernel's tanh (<= 8 ulp of the cap, generous) and
    a sink's logit (its fp32 rounding, 8 ulp of |sink|) are score errors of their own, the cap
    (Lipschitz 1) passes the others through. Returns [Hq].
    """
    q = as_f32(q).astype(np.float64)
    k = as_f32(k).astype(np.float64) if k.dtype != np.float64 else k
    v = as_f32(v).astype(np.float64) if v.dtype != np.float64 else v
    Hq, Hkv, D = q.shape[0], k.shape[1], q.shape[1]
    T = k.shape[0]
    g = Hq // Hkv
    qk = np.einsum("hd,thd->ht", np.abs(q), np.repeat(np.abs(k), g, axis=1)) * scale   # [Hq, T]
    ds = qk.max(axis=1)                                                                  # [Hq]
    vmax = np.repeat(np.abs(v).max(axis=(0, 2)), g)                                      # [Hq]
    u = UNIT_ROUNDOFF[kv_dtype]
    u32 = UNIT_ROUNDOFF["fp32"] * (4 * np.sqrt(D) + np.log2(T + 1) + 8)
    extra = 2 * 8 * UNIT_ROUNDOFF["fp32"] * ((softcap or 0.0) + (np.abs(sinks) if sinks is not None else 0.0))
    return vmax * (u + 2 * u * ds) + vmax * (u32 + 2 * u32 * ds) + vmax * extra + 1e-30


def fp32_tolerance(q, k, v, scale, softcap=None, sinks=None):
    """Bound on |o - o_ref| when o_ref uses exactly the values the store holds: fp32 arithmetic only."""
    return tolerance(q, k, v, scale, "fp32", softcap, sinks)
