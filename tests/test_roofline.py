"""Compute roofline: the multiply-add count per page (rworker/roofline.py) against the kernel's
loops counted by hand, and the extension's issue-rate probe (fma_rate)."""
from __future__ import annotations

import math

import pytest

from rworker import available_isas, cpu_features
from rworker import isa as isa_mod
from rworker.roofline import compute_bound_gbps, page_ops


def test_llama3_bf16_page_counted_by_hand():
    # g = 4, D = 128, one page of 32 tokens: scores by vdpbf16ps = 4 heads x 64 word rows x 2
    # halves of 16 tokens = 512; PV = 4 heads x 8 vectors of 16 dims x 32 tokens = 1024 FMAs
    ops = page_ops(4, 128, "bf16", bf16_dot=True)
    assert (ops.scores_dot, ops.scores_fma, ops.pv_dot, ops.pv_fma) == (512, 0, 0, 1024)
    assert ops.kv_bytes == 2 * 32 * 128 * 2 == 16384
    # V in token pairs: 4 heads x 8 vectors x 16 token pairs = 512 vdpbf16ps
    pairs = page_ops(4, 128, "bf16", bf16_dot=True, v_pairs=True)
    assert (pairs.scores_dot, pairs.pv_dot, pairs.pv_fma) == (512, 512, 0)


def test_fp32_and_padded_head_dim():
    # fp32 q: scores by FMA, 2 per head per dim (16 tokens a vector); D = 80 pads to 80, D = 72 to 80
    ops = page_ops(1, 72, "fp32", bf16_dot=False)
    assert (ops.scores_fma, ops.pv_fma, ops.scores_dot, ops.pv_dot) == (160, 160, 0, 0)
    assert ops.kv_bytes == 2 * 32 * 80 * 4


def test_bound_from_rates():
    # 1 FMA and 1 dot per ns: Llama-3 bf16 is 1536 instructions for 16 KB -> 16384 / 1536 GB/s
    ops = page_ops(4, 128, "bf16", bf16_dot=True)
    assert compute_bound_gbps(ops, 1.0, 1.0) == pytest.approx(16384 / 1536)
    # a dot twice as fast halves only the scores' part
    assert compute_bound_gbps(ops, 1.0, 2.0) == pytest.approx(16384 / (1024 + 256))
    with pytest.raises(ValueError):
        compute_bound_gbps(ops, 0.0, 1.0)


@pytest.mark.parametrize("bad", [dict(group=0, head_dim=64, kv_dtype="bf16", bf16_dot=True),
                                 dict(group=1, head_dim=64, kv_dtype="int8", bf16_dot=False),
                                 dict(group=1, head_dim=64, kv_dtype="fp32", bf16_dot=True),
                                 dict(group=1, head_dim=64, kv_dtype="bf16", bf16_dot=False, v_pairs=True)])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        page_ops(**bad)


def test_fma_rate_probe():
    """Each build measures what it can execute here and refuses the rest by name."""
    for name in available_isas():
        mod = isa_mod.load(name)
        kinds = {"avx512": ["zmm", "ymm"], "avx2": ["ymm"], "portable": []}[name]
        if name == "avx512" and "avx512bf16" in cpu_features():
            kinds.append("zmm_dpbf16")
        for kind in kinds:
            rate = mod.fma_rate(kind, 0.02)
            assert math.isfinite(rate) and rate > 0.05, (name, kind, rate)   # > 50 M instructions/s
        with pytest.raises(ValueError, match="not measurable"):
            mod.fma_rate("zmm" if name != "avx512" else "xmm")
        with pytest.raises(ValueError, match="seconds"):
            mod.fma_rate(kinds[0] if kinds else "ymm", 0)
    for name in isa_mod.emulated_isas():                 # SIMDe: no hardware rate to measure
        with pytest.raises(ValueError, match="not measurable"):
            isa_mod.load(name).fma_rate("zmm")
