"""The compute roofline of decode attention on the AVX-512 path: multiply-add instructions per KV
byte, and the rate a core issues them (`fma_rate` of the extension), give the fastest the kernel
can stream KV if memory were free. Set beside the read bandwidth, it says which one bounds a shape
on a core (bench/kernel/compute_roofline.py, bench/kernel/NOTES.md "Compute roofline, one core").

Per page of PT = 32 tokens of one KV head (simd.h), with g query heads on it and Dp = head_dim
rounded up to 16, counted in 512-bit instructions:
- scores: bf16 q and bf16 K on AVX512-BF16 take one vdpbf16ps per head per K word row per 16
  tokens: g * Dp/2 * 2 = g * Dp; otherwise one FMA per head per dim per 16 tokens: 2 * g * Dp;
- PV: one FMA per head per 16 dims per token: 2 * g * Dp; with V in token pairs (bf16
  probabilities) one vdpbf16ps per head per 16 dims per token pair: g * Dp.
The page holds 2 * 32 * Dp values of K and V. Everything else (bf16 widening, broadcasts, the
softmax) is not counted, so the bound is an upper one.
"""
from __future__ import annotations

from dataclasses import dataclass

from rworker.protocol.kvformat import KV_DTYPES, PAGE_TOKENS, kv_itemsize


@dataclass(frozen=True)
class PageOps:
    scores_dot: int   # vdpbf16ps in the scores pass
    scores_fma: int   # 512-bit FMAs in the scores pass
    pv_dot: int       # vdpbf16ps in the PV pass (V in token pairs)
    pv_fma: int       # 512-bit FMAs in the PV pass
    kv_bytes: int     # K and V bytes of the page

    def seconds(self, fma_per_ns: float, dot_per_ns: float) -> float:
        """Time of the counted instructions at the given issue rates (instructions per ns)."""
        if fma_per_ns <= 0 or dot_per_ns <= 0:
            raise ValueError(f"rates must be > 0, got fma {fma_per_ns}, dot {dot_per_ns}")
        return ((self.scores_fma + self.pv_fma) / fma_per_ns + (self.scores_dot + self.pv_dot) / dot_per_ns) * 1e-9


def page_ops(group: int, head_dim: int, kv_dtype: str, bf16_dot: bool, v_pairs: bool = False) -> PageOps:
    """Multiply-add instructions of one page (AVX-512 path). bf16_dot: the scores take vdpbf16ps
    (bf16 KV, bf16 q, a CPU with AVX512-BF16); v_pairs: V in token pairs (needs bf16_dot's conditions)."""
    if group < 1 or head_dim < 1 or kv_dtype not in KV_DTYPES:
        raise ValueError(f"page_ops: group {group} and head_dim {head_dim} must be >= 1, kv_dtype one of "
                         f"{sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype == "int8":
        raise ValueError("page_ops counts the fp32/bf16/fp16 passes; int8's integer passes (csrc/avx512/quant.h) "
                         "are measured, not counted: bench/kernel/int8_bench.py")
    if (bf16_dot or v_pairs) and kv_dtype != "bf16":
        raise ValueError(f"page_ops: vdpbf16ps needs bf16 KV, got {kv_dtype}")
    if v_pairs and not bf16_dot:
        raise ValueError("page_ops: V in token pairs runs only where the scores take vdpbf16ps")
    dp = -(-head_dim // 16) * 16
    gd = group * dp
    return PageOps(scores_dot=gd if bf16_dot else 0, scores_fma=0 if bf16_dot else 2 * gd,
                   pv_dot=gd if v_pairs else 0, pv_fma=0 if v_pairs else 2 * gd,
                   kv_bytes=2 * PAGE_TOKENS * dp * kv_itemsize(kv_dtype))


def compute_bound_gbps(ops: PageOps, fma_per_ns: float, dot_per_ns: float) -> float:
    """KV GB/s one core streams if it did nothing but the counted multiply-adds."""
    return ops.kv_bytes / ops.seconds(fma_per_ns, dot_per_ns) / 1e9
