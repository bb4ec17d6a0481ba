"""The kernel modules' causal prompt pass (csrc/avx512/prefill.h) against a float64 reference,
on every build that has it (the AVX512-BF16 hardware path where the CPU has it, the SIMDe
emulation anywhere), and its dispatch from prompt_attention (model/prompt_kernel.py).

The bound is the pass's own rounding, derived, not fitted: probabilities rounded to bf16 for the
product with V (relative 2^-8 each, so |error| <= 2^-8 sum_j p_j |v_j|) and the output rounded
to bf16 (2^-8 |o|); the fp32 scores and base-2 exponential add ~1e-6 relative.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from fastdecode.model import prompt_attention as pa
from fastdecode.model import prompt_kernel
from kvstore_cases import BF16_DOT_ISAS, BASE_ISAS

BF16_U = 2.0 ** -8
SHAPES = [  # (n, p, Hq, Hkv, D): one token; page edges 31/32/33; a chunk after earlier keys; MHA, GQA 3/4/8; D 16..128
    (1, 0, 1, 1, 16), (31, 0, 9, 3, 64), (32, 0, 4, 1, 64), (33, 0, 8, 2, 128), (200, 0, 9, 3, 64),
    (57, 64, 6, 2, 32), (40, 5, 16, 2, 80), (130, 100, 8, 8, 64),
]


def module(isa: str):
    return importlib.import_module(f"rworker._kernels_{isa}")


def packed_qkv(n: int, p: int, hq: int, hkv: int, d: int, seed: int, spread: float = 2.0):
    """q [n, Hq, D], k/v [p + n, Hkv, D] as views of one packed bf16 tensor (the S-part's fused
    projection's layout: strided tokens), the earlier p keys' queries unused."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(p + n, hq + 2 * hkv, d, generator=g) * spread).bfloat16()
    return qkv[p:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


def reference(q, k, v):
    """float64 causal attention, query i at position p + i -> (o [n, Hq, D], bound [n, Hq, D])."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    n, hq, d = q.shape
    t, hkv = k.shape[:2]
    rep = hq // hkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("nhd,thd->hnt", q, k) * d ** -0.5
    s[:, np.arange(t)[None, :] > (t - n + np.arange(n))[:, None]] = -np.inf
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("hnt,thd->nhd", prob, v)
    bound = BF16_U * (np.abs(o) + np.einsum("hnt,thd->nhd", prob, np.abs(v))) * 1.05 + 1e-6
    return o, bound


def run_pass(fn, q, k, v, rows: int = 48, threads: int = 2) -> torch.Tensor:
    n, hq, d = q.shape
    out = torch.full((n, hq, d), float("nan"), dtype=torch.bfloat16)
    assert fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
              n, k.shape[0] - n, hq, k.shape[1], d, d ** -0.5, threads, rows)
    return out


@pytest.mark.parametrize("isa", BF16_DOT_ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-p{}-h{}x{}-d{}".format(*s))
def test_the_pass_is_within_its_rounding_of_float64(isa, shape):
    q, k, v = packed_qkv(*shape, seed=sum(shape))
    o = run_pass(module(isa).prompt_attention, q, k, v).double().numpy()
    ref, bound = reference(q, k, v)
    assert np.isfinite(o).all()
    err = np.abs(o - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g} at {np.unravel_index(np.argmax(err - bound), err.shape)}"


@pytest.mark.parametrize("isa", BF16_DOT_ISAS)
def test_rows_threads_and_peaked_scores_change_nothing_beyond_the_bound(isa):
    """Blocks of 1..96 rows and 1 or 2 threads give identical bits (an item's arithmetic depends on
    its rows only through the order rows are skipped, not their sums); scores far apart (spread 8:
    softmax nearly one-hot, the running max moving) stay within the bound."""
    fn = module(isa).prompt_attention
    q, k, v = packed_qkv(150, 20, 8, 2, 64, seed=7, spread=8.0)
    base = run_pass(fn, q, k, v)
    ref, bound = reference(q, k, v)
    assert (np.abs(base.double().numpy() - ref) <= bound).all()
    for rows, threads in ((1, 1), (7, 2), (96, 1), (48, 1)):
        assert torch.equal(run_pass(fn, q, k, v, rows, threads), base), (rows, threads)


@pytest.mark.parametrize("isa", [i for i in BASE_ISAS if i in ("portable", "avx2")])
def test_builds_without_bf16_dot_products_decline_and_write_nothing(isa):
    q, k, v = packed_qkv(20, 0, 4, 2, 32, seed=3)
    out = torch.zeros(20, 4, 32, dtype=torch.bfloat16)
    assert module(isa).prompt_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                        v.stride(0), out.data_ptr(), 20, 0, 4, 2, 32, 0.1, 1) is False
    assert not out.any()


@pytest.mark.parametrize("isa", BF16_DOT_ISAS)
def test_bad_geometry_is_a_value_error(isa):
    fn = module(isa).prompt_attention
    with pytest.raises(ValueError, match="multiple"):
        fn(0, 0, 0, 0, 0, 0, 0, 4, 0, 5, 2, 64, 0.1, 1)       # 5 query heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(0, 0, 0, 0, 0, 0, 0, 4, 0, 4, 2, 40, 0.1, 1)


def test_prompt_attention_takes_the_pass_for_plain_causal_bf16_only(monkeypatch):
    """Dispatch: plain causal bf16 on the CPU goes to the pass (a chunk with its context too);
    float32, a head dim not a multiple of 16, soft-cap, sinks and a window inside the keys go to
    the torch paths; a declining build (False) falls back to SDPA with the same result."""
    calls = []

    def spy(*args):
        calls.append(args[7:9])                         # (n, p)
        return real(*args)

    real = module(BF16_DOT_ISAS[0]).prompt_attention if BF16_DOT_ISAS else (lambda *a: False)
    monkeypatch.setattr(prompt_kernel, "_kernel", spy)
    q, k, v = packed_qkv(40, 0, 4, 2, 32, seed=11)
    pa.prompt_attention(q, k, v, [25, 15], None, 32 ** -0.5)
    assert calls == [(25, 0), (15, 0)]
    kc, vc = packed_qkv(30, 10, 4, 2, 32, seed=12)[1:]     # chunk of 30 after 10 earlier keys
    pa.prompt_attention(q[:30], k[:30], v[:30], [30], [(kc, vc)], 32 ** -0.5)
    assert calls[-1] == (30, 10)
    calls.clear()
    pa.prompt_attention(q.float(), k.float(), v.float(), [40], None, 0.2)
    pa.prompt_attention(q, k, v, [40], None, 0.2, softcap=30.0)
    pa.prompt_attention(q, k, v, [40], None, 0.2, sinks=torch.zeros(4))
    pa.prompt_attention(q, k, v, [40], None, 0.2, window=16)
    q24, k24, v24 = packed_qkv(10, 0, 2, 1, 24, seed=13)
    pa.prompt_attention(q24, k24, v24, [10], None, 0.2)
    assert calls == []
    pa.prompt_attention(q, k, v, [40], None, 0.2, window=40)    # a window that reaches every key: plain
    assert calls == [(40, 0)]

    monkeypatch.setattr(prompt_kernel, "_kernel", lambda *a: False)
    declined = pa.prompt_attention(q, k, v, [40], None, 32 ** -0.5)
    ref, bound = reference(q, k, v)
    assert (np.abs(declined.double().numpy() - ref) <= 2 * bound).all()


def test_the_variable_turns_the_pass_off(monkeypatch):
    monkeypatch.setattr(prompt_kernel, "_kernel", None)
    monkeypatch.setenv("FASTDECODE_PROMPT_KERNEL", "0")
    assert not prompt_kernel.available()
    q, k, v = packed_qkv(8, 0, 2, 1, 32, seed=5)
    assert prompt_kernel.causal(q, k, v, 0.2) is None


@pytest.mark.parametrize("isa", BF16_DOT_ISAS)
def test_a_long_context_released_and_packed_again_gives_the_same_bits(isa):
    """64 queries after 8,200 earlier keys at 8 kv heads x 128 dims: ~34 MB of packed pages, above
    what a call keeps for the next (prefill.h: PROMPT_PAGES_KEPT_BYTES), so the second call
    packs into a new buffer; a short call between them reuses the small one."""
    fn = module(isa).prompt_attention
    q, k, v = packed_qkv(64, 8200, 8, 8, 128, seed=21, spread=1.0)
    first = run_pass(fn, q, k, v)
    ref, bound = reference(q, k, v)
    assert (np.abs(first.double().numpy() - ref) <= bound).all()
    small = packed_qkv(40, 3, 4, 2, 64, seed=22)
    ref_s, bound_s = reference(*small)
    assert (np.abs(run_pass(fn, *small).double().numpy() - ref_s) <= bound_s).all()
    assert torch.equal(run_pass(fn, q, k, v), first)
