"""int8 KV store (csrc/avx512/quant.h): decode attention against float64 numpy references, held to
an error bound derived from the quantization scales. The modelled arithmetic, the three references
and the bound, with its full statement: tests/int8_ref.py; paths, stores and data: tests/int8_cases.py.

Here: a canary that the build has the modelled arithmetic, ragged batches (every length class, MHA
and GQA, head dims 64, 128 and odd ones, a 16k sequence) within the bound, the mean error asserted
well below it for gaussian data, and bitwise agreement with VNNI on and off, in or out of a batch,
on 1 or 2 threads and through append_attend. Inputs (bf16, zero and NaN rows, bad arrays) and the
store's size: tests/test_int8_kernel_inputs.py.

Paths: every ISA this host runs (rworker.isa), the AVX-512 builds with FASTDECODE_VNNI on and off
(set before the store is created: the flag is read then); the SIMDe emulation only on small cases.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from int8_cases import (  # noqa: E402
    ALL_PATHS,
    EMU_PATHS,
    HAS_VNNI,
    PATHS,
    append_ragged,
    make_kv,
    open_i8,
    path_id,
    run_case,
)
from int8_ref import F32, PT, Q_PARTS, QSTEP, W_PARTS, WSTEP, check_seq, hadamard, report  # noqa: E402
from kvstore_cases import BASE_ISAS, BF16_DOT_ISAS  # noqa: E402

from rworker import isa as isa_mod  # noqa: E402

CH = 512                   # tokens per split-KV chunk (attention.h)


def probe_cases(c, D=64):
    """Three two-token sequences (token 0: zero key, v = 127 e_0; token 1: v = 127 e_1) on which
    each simplification of the modelled arithmetic moves the output by far more than the third
    bound (the kernel's q^ and k^): w = the weight of token 1 is 0.4 page-weight steps (one 7-bit
    part rounds it to 0: o[1] 0 instead of ~0.40), q = the turned query's dim 1 is 0.3 steps (one
    int8 part drops it: o[1] = 63.5 instead of ~92.8), k = key [127, 0.3] unturned (stored without
    the rotation its 0.3 would round away: o[1] = 63.5 instead of ~106). Returns {name: (q, k, v)}."""
    e = np.eye(D)
    H = hadamard(e, np.float64)                   # symmetric, its own inverse: H @ x turns x
    v = np.zeros((2, 1, D), F32)
    v[0, 0, 0] = v[1, 0, 1] = 127
    out = {}
    for name, q_turned, k1 in [("w", e[0], H @ e[0] * math.log(0.4 / 127) / c),
                               ("q", e[0] + e[1] * 0.3 / 127, H @ e[1] * 127 / (0.3 * c)),
                               ("k", None, (e[0] * 127 + e[1] * 0.3))]:
        k = np.zeros((2, 1, D), F32)
        k[1, 0] = k1
        q = (H @ q_turned if q_turned is not None else e[1] / (0.3 * c)).astype(F32)[None]
        out[name] = (q, k, v)
    return out


@pytest.mark.parametrize("path", ALL_PATHS, ids=path_id)
def test_the_build_has_the_modelled_arithmetic(monkeypatch, path):
    """Canary for the model (tests/int8_ref.py: Q_PARTS, W_PARTS, turned keys and queries): on the probe cases a
    build that differs fails the tight third bound by a wide margin, with a message saying which."""
    st = open_i8(monkeypatch, path, 1, 1, 64, threads=1)
    for i, (name, (q, k, v)) in enumerate(probe_cases(st.scale).items()):
        st.append(0, [i, i], k, v)
        o = st.attend(0, [i], q[None])
        print(f"{path_id(path)} probe {name}: o[:2] = {o[0, 0, :2]}")
        check_seq(o[0], q, k, v, st, f"{path_id(path)} probe {name} (Q_PARTS={Q_PARTS}, W_PARTS={W_PARTS}, turned K)")



# ---------------------------------------------------------------------------------------------
# accuracy: ragged batches within the bound

# lengths: 1, partial pages, page edges 31/32/33, two pages, chunk edges 511/512/513 (split-KV merge
# from 513 on), several chunks
LENGTHS = [1, 5, PT - 1, PT, PT + 1, 2 * PT, 100, CH - 1, CH, CH + 1, 1100]
SHAPES = [(2, 1, 64), (2, 4, 64), (4, 1, 128), (2, 4, 128)]     # (Hkv, g, D): MHA and GQA


@pytest.mark.parametrize("Hkv,g,D", SHAPES, ids=[f"{'mha' if g == 1 else f'gqa{g}'}-D{D}" for _, g, D in SHAPES])
@pytest.mark.parametrize("path", PATHS, ids=path_id)
def test_ragged_batch_within_bound(monkeypatch, path, Hkv, g, D):
    """Gaussian data (the mean error also asserted small) and data with outliers, per path and shape."""
    rng = np.random.default_rng([D, g, len(path_id(path))])
    label = f"{path_id(path)} Hkv={Hkv} g={g} D={D}"
    st = open_i8(monkeypatch, path, 2, Hkv, D)
    stats = run_case(st, rng, LENGTHS, g, "gaussian", 1.0, label + " gaussian")
    report(label + " gaussian", stats)
    fine = 2 * max(QSTEP, WSTEP)                        # 1 (one part each), 1/254 (two parts each)
    for s in stats:
        # not vacuous: the typical error is a fraction of one V quantization step (T=1: exactly
        # the V rounding, mean step/4), far below the worst-case bound; against the dequantized
        # reference (query and page-weight rounding only) below `fine` of a step
        assert s["mean1"] < 0.5 * s["step"], f"{label} T={s['T']}: mean|err| {s['mean1']:.3g} vs step {s['step']:.3g}"
        assert s["mean2"] < fine * s["step"], (f"{label} T={s['T']}: mean|err| {s['mean2']:.3g} vs the dequantized "
                                               f"reference, V step {s['step']:.3g} x {fine:.3g}")
    st2 = open_i8(monkeypatch, path, 2, Hkv, D)
    report(label + " outliers", run_case(st2, rng, LENGTHS[::2], g, "outliers", 2.5, label + " outliers"))


@pytest.mark.parametrize("path", PATHS, ids=path_id)
def test_16k_sequence_in_a_ragged_batch(monkeypatch, path):
    """One 16k-token sequence (32 split-KV chunks merged) beside short ones, GQA, D=128."""
    rng = np.random.default_rng(16384)
    st = open_i8(monkeypatch, path, 2, 2, 128)
    label = f"{path_id(path)} 16k"
    stats = run_case(st, rng, [16384, 1, 33, 700], 4, "gaussian", 1.5, label, max_chunk=4000)
    report(label, stats)
    long = next(s for s in stats if s["T"] == 16384)
    assert long["mean1"] < 0.1 * long["step"], f"16k: mean|err| {long['mean1']:.3g} vs V step {long['step']:.3g}"


SMALL = [(p, D) for p in EMU_PATHS for D in (64, 128, 80, 33)] + [(p, D) for p in PATHS for D in (80, 33)]


@pytest.mark.parametrize("path,D", SMALL, ids=[f"{path_id(p)}-D{D}" for p, D in SMALL])
def test_small_cases_and_odd_head_dims(monkeypatch, path, D):
    """The SIMDe build (slow) on small cases, head dims 64 and 128; odd head dims (80, 33: padded
    to 80, 48) on every path."""
    rng = np.random.default_rng(D)
    st = open_i8(monkeypatch, path, 2, 2, D)
    label = f"{path_id(path)} D={D}"
    report(label, run_case(st, rng, [1, 7, 32, 33, 70, 530], 2, "outliers", 2.0, label))


# ---------------------------------------------------------------------------------------------
# bitwise: VNNI on and off, batch, threads, fused append_attend


@pytest.mark.parametrize("D", [64, 128, 80])
@pytest.mark.parametrize("isa", [i for i in BASE_ISAS if i in ("avx512", "avx512emu")])
def test_vnni_on_and_off_give_the_same_bits(monkeypatch, isa, D):
    """vpdpbusd (biased K bytes, bias sum subtracted) and vpmaddubsw (signs moved onto K) compute
    the same integers, and the fp32 epilogue is the same code: the outputs must agree to the bit."""
    if isa == "avx512" and not HAS_VNNI:
        pytest.skip("this CPU has no AVX512-VNNI")
    rng = np.random.default_rng(D + 7)
    Hkv, g = 2, 4
    lengths = [1, 33, 200] if isa == "avx512emu" else [1, 33, 200, 600, 2000]
    data = {s: make_kv(rng, T, Hkv, D, "outliers") for s, T in enumerate(lengths)}
    ids = np.arange(len(lengths), dtype=np.int64)
    q = (rng.standard_normal((len(ids), Hkv * g, D)) * 2).astype(F32)
    stores = [open_i8(monkeypatch, (isa, vnni), 1, Hkv, D) for vnni in (True, False)]
    assert_same_bits(stores, data, ids, q, f"{isa} D={D}")


def assert_same_bits(stores, data, ids, q, label):
    """The same ragged appends into each store: one call's outputs equal to the bit, finite, and
    within int8_ref's bounds."""
    outs = []
    for st in stores:
        append_ragged(st, 0, data, np.random.default_rng(1), 50)
        outs.append(st.attend(0, ids, q))
    assert np.isfinite(outs[-1]).all()
    for o in outs[:-1]:
        assert np.array_equal(o, outs[-1]), f"{label}: max diff {np.abs(o - outs[-1]).max():.3g}"
    for i in ids:
        check_seq(outs[-1][i], q[i], *data[i], stores[-1], f"{label} T={len(data[i][0])}")


AMX_ISAS = BF16_DOT_ISAS               # where a store takes the AMX modes (the emulation on any of them)
AMX_MODES = ["emulate"] + (["on"] if "amx-int8" in isa_mod.cpu_features() else [])


@pytest.mark.parametrize("mode", AMX_MODES)
@pytest.mark.parametrize("Hkv,g,D", [(2, 4, 64), (1, 3, 128), (1, 20, 64), (2, 1, 64), (2, 4, 80)],
                         ids=["gqa4-D64", "gqa3-D128", "gqa20-D64", "mha-D64", "gqa4-D80"])
@pytest.mark.parametrize("isa", AMX_ISAS)
def test_amx_tiles_give_the_avx512_int8_bits(monkeypatch, isa, Hkv, g, D, mode):
    """The int8 passes on the AMX tiles (csrc/avx512/amx_i8.h: tdpbsud for the scores, tdpbusd for
    PV, rows stacked up to 16 a product, GQA 20 in two) compute the AVX-512 passes' integers and
    their fp32 epilogues: the outputs equal the AVX-512 int8 path's to the bit, on ragged lengths,
    partial pages (old bytes past the tokens, weighed 0) and split-KV chunks. MHA rows alone and
    head dims off 64-dim steps (80) keep the AVX-512 passes."""
    if isa == "avx512emu" and (D > 64 or g > 4):
        pytest.skip("the SIMDe build under the AMX emulation: the small shapes are enough")
    rng = np.random.default_rng([D, g, Hkv])
    lengths = [1, 33, 200] if isa == "avx512emu" else [1, 5, 33, 200, 600, 1100]
    data = {s: make_kv(rng, T, Hkv, D, "outliers") for s, T in enumerate(lengths)}
    ids = np.arange(len(lengths), dtype=np.int64)
    q = (rng.standard_normal((len(ids), Hkv * g, D)) * 2).astype(F32)
    stores = [open_i8(monkeypatch, (isa, HAS_VNNI or isa == "avx512emu"), 1, Hkv, D) for _ in range(2)]
    stores[1].amx = mode
    assert_same_bits(stores, data, ids, q, f"{isa} amx={mode} D={D}")


@pytest.mark.parametrize("path", ALL_PATHS, ids=path_id)
def test_bits_independent_of_batch_threads_and_fusion(monkeypatch, path):
    """A sequence's output is the same bits alone or in a batch, on 1 or 2 threads, and when the
    last token comes through append_attend instead of append + attend."""
    rng = np.random.default_rng(5)
    Hkv, g, D = 2, 2, 64
    lengths = [40, 600] if path[0] == "avx512emu" else [40, 600, 1500]
    data = {s: make_kv(rng, T, Hkv, D, "gaussian") for s, T in enumerate(lengths)}
    ids = np.arange(len(lengths), dtype=np.int64)
    q = rng.standard_normal((len(ids), Hkv * g, D)).astype(F32)
    a = open_i8(monkeypatch, path, 1, Hkv, D, threads=2)
    b = open_i8(monkeypatch, path, 1, Hkv, D, threads=1)
    # a: all but the last token, then append_attend; b: everything appended, then attend one by one
    append_ragged(a, 0, {s: (k[:-1], v[:-1]) for s, (k, v) in data.items()}, np.random.default_rng(2), 64)
    last_k = np.stack([k[-1] for k, _ in data.values()])
    last_v = np.stack([v[-1] for _, v in data.values()])
    oa = a.append_attend(0, ids, q, last_k, last_v)
    append_ragged(b, 0, data, np.random.default_rng(3), 16)
    ob = np.concatenate([b.attend(0, ids[i:i + 1], q[i:i + 1]) for i in range(len(ids))])
    assert np.array_equal(oa, ob)
    oc = a.attend(0, ids[::-1], np.ascontiguousarray(q[::-1]))[::-1]
    assert np.array_equal(oa, oc)
    check_seq(oa[1], q[1], *data[1], a, f"{path_id(path)} fused")
