"""V in token pairs (v_tile = V_PAIRS, csrc/avx512/simd_avx512.h): bf16 KV on a CPU with AVX512-BF16 (or
its SIMDe emulation), the page's probabilities rounded to bf16 for the PV dot products. It gives
other bits than the other layouts by design, so it is held to a bound derived for that rounding,
against the float64 reference; the rest (odd appends, page reuse, determinism) as for any layout."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batch_line, read_output, run_fastdecode  # noqa: E402
from kernel_ref import UNIT_ROUNDOFF, attention_ref, bf16_bits_to_f32, f32_to_bf16_bits, fp32_tolerance  # noqa: E402
from kvstore_cases import BASE_ISAS, ISAS, open_store  # noqa: E402

from rworker import (
    KVStore,  # noqa: E402
    tune,  # noqa: E402
)
from rworker.kvstore import V_PAIRS  # noqa: E402

PAIR_ISAS = [i for i in BASE_ISAS if KVStore(1, 1, 64, "bf16", threads=1, isa=i).has_v_pairs]
# and under the AMX tiles (amx.h: scores and, on whole pages, PV): emulated, and the instructions where they run
PAIR_PATHS = PAIR_ISAS + [p for p in ISAS if "+amx" in p and p.split("+")[0] in PAIR_ISAS]
needs_pairs = pytest.mark.skipif(not PAIR_ISAS, reason="no path with V pairs here (needs AVX512-BF16 or the SIMDe build)")


def pairs_store(Hkv, D, path, threads=2, v_tile=V_PAIRS):
    return open_store(1, Hkv, D, "bf16", threads=threads, isa=path, v_tile=v_tile)


def pairs_bound(q, k, v, scale):
    """fp32 arithmetic (kernel_ref.fp32_tolerance) plus every probability rounded to bf16: o moves
    by sum_t (p_t / l) delta_t v_t with |delta_t| <= u_bf16, at most u_bf16 * max|v| per head."""
    g = q.shape[0] // k.shape[1]
    vmax = np.repeat(np.abs(v).max(axis=(0, 2)), g)
    return fp32_tolerance(q, k, v, scale) + UNIT_ROUNDOFF["bf16"] * vmax


def bf16(rng, shape, scale=1.0):
    return f32_to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))


def fill(stores, rng, lens, Hkv, D, sid0=0):
    """Each sequence appended in blocks of random size (odd starts and ends included)."""
    kv = []
    for i, L in enumerate(lens):
        k, v = bf16(rng, (L, Hkv, D)), bf16(rng, (L, Hkv, D))
        t = 0
        while t < L:
            n = min(L - t, int(rng.integers(1, 40)))
            for st in stores:
                st.append(0, [sid0 + i] * n, k[t:t + n], v[t:t + n])
            t += n
        kv.append((k, v))
    return kv


@needs_pairs
@pytest.mark.parametrize("isa", PAIR_PATHS)
@pytest.mark.parametrize("Hkv,g,D", [(3, 3, 64), (8, 4, 128), (2, 1, 80), (1, 8, 96), (2, 2, 48), (1, 16, 128), (4, 5, 32),
                                     (1, 20, 64)])
def test_pairs_match_the_reference_within_the_bf16_probability_bound(isa, Hkv, g, D):
    if isa.startswith("avx512emu+amx") and D > 64:
        pytest.skip("the SIMDe build under the AMX emulation: the small shapes are enough")
    rng = np.random.default_rng(Hkv * 1000 + g * 10 + D)
    lens = [1, 2, 63, 64, 65, 513, 1100] + ([4095, 4096] if D <= 64 else [])
    pairs = pairs_store(Hkv, D, isa)
    token_major = pairs_store(Hkv, D, isa, v_tile=0)
    assert pairs.v_tile == V_PAIRS
    kv = fill([pairs, token_major], rng, lens, Hkv, D)
    ids = list(range(len(lens)))
    for q in (bf16(rng, (len(lens), Hkv * g, D)), rng.standard_normal((len(lens), Hkv * g, D)).astype(np.float32)):
        o = pairs.attend(0, ids, q)
        assert not np.array_equal(o, token_major.attend(0, ids, q))      # the pairs path ran
        qf = bf16_bits_to_f32(q) if q.dtype == np.uint16 else q
        for i, (k, v) in enumerate(kv):
            kf, vf = bf16_bits_to_f32(k), bf16_bits_to_f32(v)
            ref = attention_ref(qf[i], kf, vf, pairs.scale)
            err = np.abs(o[i] - ref).max(axis=1)
            bound = pairs_bound(qf[i], kf, vf, pairs.scale)
            assert (err <= bound).all(), f"seq {i} (len {lens[i]}): err {err.max():.3g} > bound {bound.min():.3g}"


@needs_pairs
@pytest.mark.parametrize("isa", PAIR_PATHS)
def test_a_reused_page_never_leaks_its_old_values(isa):
    """A freed sequence's pages hold inf in V; sequences of odd lengths that get them back must
    not see 0 * inf in their unfilled pair halves (nor, under the AMX tiles, in the pair rows past
    a partial page's tokens)."""
    rng = np.random.default_rng(3)
    Hkv, g, D = 2, 2, 64
    st = pairs_store(Hkv, D, isa)
    inf = f32_to_bf16_bits(np.full((700, Hkv, D), np.inf, np.float32))
    st.append(0, [0] * 700, bf16(rng, (700, Hkv, D)), inf)
    assert st.free(0)
    lens = [1, 33, 95, 301]
    kv = fill([st], rng, lens, Hkv, D, sid0=10)
    q = bf16(rng, (len(lens), Hkv * g, D))
    o = st.attend(0, [10 + i for i in range(len(lens))], q)
    assert np.isfinite(o).all()
    for i, (k, v) in enumerate(kv):
        kf, vf = bf16_bits_to_f32(k), bf16_bits_to_f32(v)
        ref = attention_ref(bf16_bits_to_f32(q[i]), kf, vf, st.scale)
        assert (np.abs(o[i] - ref).max(axis=1) <= pairs_bound(bf16_bits_to_f32(q[i]), kf, vf, st.scale)).all()


@needs_pairs
@pytest.mark.parametrize("isa", PAIR_PATHS)
def test_pairs_output_does_not_depend_on_batch_or_threads(isa):
    rng = np.random.default_rng(5)
    Hkv, g, D = 2, 4, 128
    lens = [5, 700, 2000]
    stores = [pairs_store(Hkv, D, isa, threads=t) for t in (1, 2)]
    fill(stores, rng, lens, Hkv, D)
    q = bf16(rng, (len(lens), Hkv * g, D))
    batch = stores[1].attend(0, [0, 1, 2], q)
    for i in range(len(lens)):
        alone = stores[0].attend(0, [i], q[i:i + 1])
        assert np.array_equal(alone[0].view(np.uint32), batch[i].view(np.uint32))


def test_pairs_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="token pairs"):
        KVStore(1, 1, 64, "fp32", threads=1, v_tile=V_PAIRS)
    with pytest.raises(ValueError, match="token pairs"):
        KVStore(1, 1, 64, "bf16", threads=1, isa="portable", v_tile=V_PAIRS)
    assert not KVStore(1, 1, 64, "fp16", threads=1).has_v_pairs


@pytest.mark.skipif("avx512" not in PAIR_ISAS, reason="the dispatched path has no V pairs here")
def test_an_rworker_store_takes_pairs_from_the_environment(monkeypatch):
    """FASTDECODE_VTILE=-2 pins the layout for a bf16 R-worker (the tune stays off); an fp32 one
    keeps its build's default."""
    monkeypatch.setenv("FASTDECODE_VTILE", str(V_PAIRS))
    store, kernel = tune.open_tuned_store(2, 8, 2, 64, "bf16", 1, 64 << 20)
    assert store.v_tile == kernel.v_tile == V_PAIRS and not kernel.tuned
    store, kernel = tune.open_tuned_store(2, 8, 2, 64, "fp32", 1, 64 << 20)
    assert store.v_tile == kernel.v_tile != V_PAIRS


def test_pairs_join_the_tune_only_when_the_job_allows_them():
    allowed = tune.candidates(None, "bf16", bf16_probs=True)
    assert tune.candidates(None, "bf16") == tune.candidates(None, "fp32", bf16_probs=True) == tune.candidates()
    has = KVStore(1, 1, 64, "bf16", threads=1).has_v_pairs
    assert ((V_PAIRS, "scattered") in allowed) == has and ((V_PAIRS, "on") in allowed) == has
    assert tune.label(V_PAIRS, "scattered") == "pairs/scattered"


@pytest.mark.skipif("avx512" not in PAIR_ISAS, reason="the dispatched path has no V pairs here")
def test_the_tune_times_pairs_when_allowed():
    ch = tune.tune_kernel(8, 2, 128, "bf16", threads=2, working_set_bytes=8 << 20, rounds=2, bf16_probs=True)
    assert {"pairs/scattered", "pairs/pf"} <= set(ch.gbps)
    assert (ch.v_tile, ch.prefetch) in tune.candidates(None, "bf16", bf16_probs=True)


@pytest.mark.parametrize("ranks", [None, 2], ids=["local", "mpiexec-n2"])
def test_attn_probs_bf16_reaches_the_rworkers_tune(tmp_path, ranks):
    """--attn-probs bf16 travels with the job's hello: the R-worker (or the local backend) times
    the pair layouts too and serves whatever it picked; with fp32 KV the option is refused."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": p, "max_tokens": 8, "temperature": 0}) + "\n"
                           for i, p in enumerate(["The sky is", "One, two, three,"])))
    out = tmp_path / "out.jsonl"
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--kv-dtype", "bf16",
                           "--attn-probs", "bf16", "--rworker-mem", "200MB"], ranks=ranks, timeout=300,
                          env={"FASTDECODE_KERNEL_TUNE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernel = json.loads((tmp_path / "out.jsonl.summary.json").read_text())["rworkers"][0]["kernel"]
    if KVStore(1, 1, 64, "bf16", threads=1).has_v_pairs:
        assert "pairs/scattered" in kernel, kernel
    assert len(read_output(str(out))) == 2
    bad = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "bad.jsonl"), "--quiet",
                          "--kv-dtype", "fp32", "--attn-probs", "bf16"], ranks=None, timeout=300)
    assert bad.returncode != 0 and "--attn-probs bf16 needs bf16 KV" in bad.stderr
