"""The start-up kernel tune (rworker.tune): every candidate it may pick gives the same bits, it
picks by measured rate with a margin for noise, it can be turned off, and R-workers and the local
backend run (and report) what it picked."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batch_line, read_output, run_fastdecode  # noqa: E402
from kvstore_cases import BASE_ISAS, DTYPES, rand  # noqa: E402

from rworker import (
    KVStore,  # noqa: E402
    tune,  # noqa: E402
)
from rworker import isa as isa_mod  # noqa: E402


@pytest.mark.parametrize("isa", BASE_ISAS)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_every_candidate_gives_bitwise_the_same_outputs(isa, kv_dtype):
    """What the tune may pick (V layout x software prefetch) changes speed, never a bit: lengths
    over many pages and split-KV chunks (where the prefetch target moves to the next item), pages
    in runs (a prompt) and scattered (grown a page at a time, where "scattered" prefetches)."""
    rng = np.random.default_rng(7)
    Hkv, g, D = 2, 3, 64
    lens = [1, 33, 95, 700, 1100]
    cands = tune.candidates(isa)
    assert len(cands) >= 2 and any(pf == "scattered" for _, pf in cands)
    stores = [KVStore(1, Hkv, D, kv_dtype, threads=2, isa=isa, v_tile=vt, prefetch=pf) for vt, pf in cands]
    assert [(st.v_tile, st.prefetch) for st in stores] == cands
    for st in stores:
        st.extent_pages = 1
    for sid, L in enumerate(lens):                              # prompts: runs of pages
        k, v = rand(rng, (L, Hkv, D)), rand(rng, (L, Hkv, D))
        for st in stores:
            st.append(0, [sid] * L, k, v)
    grown = [10 + i for i in range(3)]
    for _ in range(70):                                         # round-robin growth: scattered pages
        k, v = rand(rng, (3, Hkv, D)), rand(rng, (3, Hkv, D))
        for st in stores:
            st.append(0, grown, k, v)
    assert stores[0].page_runs(10) > Hkv
    ids = list(range(len(lens))) + grown
    q = rand(rng, (len(ids), Hkv * g, D))
    outs = [st.attend(0, ids, q).view(np.uint32) for st in stores]
    for o in outs[1:]:
        assert np.array_equal(outs[0], o)
    for mode in ("off", "scattered", "on", False, True):            # switched on a live store
        stores[0].prefetch = mode
        assert np.array_equal(stores[0].attend(0, ids, q).view(np.uint32), outs[0])


def test_candidates_start_with_the_build_default():
    for isa in BASE_ISAS:
        mod = isa_mod.load(isa)
        cands = tune.candidates(isa)
        plain = KVStore(1, 1, 64, isa=isa)
        assert cands[0] == (mod.V_TILE, "on") == (plain.v_tile, plain.prefetch)
        assert len(set(cands)) == len(cands)
        assert {vt for vt, _ in cands} == {mod.V_TILE, mod.V_TILE_ALT}


def test_pick_takes_the_fastest_only_past_the_margin():
    a, b, c = (32, "on"), (0, "scattered"), (0, "on")
    cands = [a, b, c]
    assert tune.pick({a: 30.0, b: 34.0, c: 31.0}, cands, 0.02) == b
    assert tune.pick({a: 30.0, b: 30.5, c: 29.0}, cands, 0.02) == a        # 1.7%: noise, keep the default
    assert tune.pick({a: 30.0, b: 30.7, c: 29.0}, cands, 0.02) == b        # 2.3%
    assert tune.pick({a: 40.0, b: 34.0, c: 39.0}, cands, 0.0) == a
    assert tune.pick({a: 30.0, b: 31.0, c: 33.0}, cands, 0.05) == c


def test_tune_times_every_candidate_and_returns_one():
    """A small working set keeps this quick; the figures only need to be real measurements."""
    ch = tune.tune_kernel(8, 2, 128, "bf16", threads=2, working_set_bytes=8 << 20, rounds=2)
    cands = tune.tune_candidates(8, 2, 128, None, "bf16", amx=tune.amx_here()[0])   # no tiles: other bits, not allowed
    assert ch.tuned and (ch.v_tile, ch.prefetch, ch.amx) in cands
    assert set(ch.gbps) == {tune.label(*c) for c in cands}
    assert all(r > 0 and np.isfinite(r) for r in ch.gbps.values())
    assert 8 << 20 <= ch.working_set_bytes < (8 << 20) + 1024 * 2 * 2 * 128 * 2
    assert ch.seconds > 0 and "tuned" in ch.describe()
    rates = {c: ch.gbps[tune.label(*c)] for c in cands}
    assert (ch.v_tile, ch.prefetch, ch.amx) == tune.pick(rates, cands, 0.02)
    with pytest.raises(ValueError):
        tune.tune_kernel(9, 2, 64, "bf16", working_set_bytes=1 << 20)


def test_tune_off_or_pinned_layout_keeps_the_default(monkeypatch):
    mod = isa_mod.load(None)
    monkeypatch.setenv("FASTDECODE_KERNEL_TUNE", "0")
    ch = tune.choose_kernel(9, 3, 64, "bf16", threads=1)
    assert not ch.tuned and (ch.v_tile, ch.prefetch) == (mod.V_TILE, "on")
    monkeypatch.setenv("FASTDECODE_KERNEL_TUNE", "1")
    monkeypatch.setenv("FASTDECODE_PREFETCH", "0")                  # a user measuring one variant
    ch = tune.choose_kernel(9, 3, 64, "bf16", threads=1)
    assert not ch.tuned and ch.prefetch == "off" and "untuned" in ch.describe()
    monkeypatch.setenv("FASTDECODE_PREFETCH", "scattered")
    ch = tune.choose_kernel(9, 3, 64, "bf16", threads=1)
    assert not ch.tuned and ch.prefetch == "scattered" and "prefetch scattered" in ch.describe()
    monkeypatch.delenv("FASTDECODE_PREFETCH")
    monkeypatch.setenv("FASTDECODE_VTILE", str(mod.V_TILE_ALT))
    ch = tune.choose_kernel(9, 3, 64, "bf16", threads=1)
    assert not ch.tuned and ch.v_tile == mod.V_TILE_ALT and ch.prefetch == "on"


def test_prefetch_modes_by_name_bool_or_env(monkeypatch):
    assert KVStore(1, 1, 64, prefetch=False).prefetch == "off"
    assert KVStore(1, 1, 64, prefetch=True).prefetch == "on"
    assert KVStore(1, 1, 64, prefetch="scattered").prefetch == "scattered"
    for bad in ("sometimes", 2, None):
        with pytest.raises(ValueError, match="prefetch must be one of"):
            KVStore(1, 1, 64).prefetch = bad
    for env, mode in (("0", "off"), ("off", "off"), ("1", "on"), ("on", "on"), ("scattered", "scattered")):
        monkeypatch.setenv("FASTDECODE_PREFETCH", env)
        assert KVStore(1, 1, 64).prefetch == mode, env


def test_probe_working_set_is_bounded_by_capacity(monkeypatch):
    monkeypatch.setenv("FASTDECODE_KERNEL_TUNE", "1")
    seen = {}
    monkeypatch.setattr(tune, "tune_kernel", lambda *a, **kw: seen.update(kw) or tune.default_choice())
    tune.choose_kernel(9, 3, 64, "bf16", threads=1, capacity_bytes=96 << 20)
    n_layouts = len({vt for vt, _ in tune.candidates()})
    assert seen["working_set_bytes"] == (96 << 20) // (4 * n_layouts)
    tune.choose_kernel(9, 3, 64, "bf16", threads=1, capacity_bytes=1 << 40)
    assert seen["working_set_bytes"] <= tune.MAX_WORKING_SET


@pytest.mark.parametrize("ranks", [None, 2], ids=["local", "mpiexec-n2"])
def test_workers_run_and_report_the_tuned_kernel(tmp_path, ranks):
    """With the tune on, the R-worker (or the local backend) tunes at start-up, says what it picked
    in the run summary (and the roster on stderr under MPI), and the tokens match a run without it."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": p, "max_tokens": 12, "temperature": 0}) + "\n"
                           for i, p in enumerate(["The sky is", "One, two, three,"])))
    outs = {}
    for flag in ("1", "0"):
        out = tmp_path / f"out{flag}.jsonl"
        # not --quiet: the roster on stderr names the kernel
        # the AMX tiles off: they give other bits (by the order of fp32 sums), the other candidates none
        proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "bf16",
                               "--rworker-mem", "200MB"], ranks=ranks, timeout=300,
                              env={"FASTDECODE_KERNEL_TUNE": flag, "FASTDECODE_AMX": "0"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        kernel = json.loads((tmp_path / f"out{flag}.jsonl.summary.json").read_text())["rworkers"][0]["kernel"]
        if flag == "1":
            assert "tuned in" in kernel and "MiB" in kernel, kernel
            if ranks:
                assert "; kernel v_tile" in proc.stderr
        else:
            assert "(untuned)" in kernel, kernel
        outs[flag] = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read_output(str(out))}
    assert outs["1"] == outs["0"] and len(outs["1"]) == 2


def test_a_probe_short_of_memory_leaves_the_default(monkeypatch):
    """A node that cannot hold the probe still serves: untuned, with the build's default."""
    monkeypatch.setenv("FASTDECODE_KERNEL_TUNE", "1")

    def no_memory(*a, **kw):
        raise MemoryError("probe")
    monkeypatch.setattr(tune, "tune_kernel", no_memory)
    store, ch = tune.open_tuned_store(2, 9, 3, 64, "bf16", 1, 64 << 20)
    assert not ch.tuned and (store.v_tile, store.prefetch) == tune.candidates()[0]
    assert store.num_layers == 2 and store.capacity_bytes == 64 << 20


# ---------------------------------------------------------------------------------------------
# the AMX tiles as candidates (amx.h; emulated here wherever the AVX512-BF16 scores run)

BF16_DOT = [i for i in BASE_ISAS if i == "avx512emu" or (i == "avx512" and "avx512bf16" in isa_mod.cpu_features())]
needs_bf16_dot = pytest.mark.skipif(not BF16_DOT, reason="no AVX512-BF16 path here (nor the SIMDe build)")


@needs_bf16_dot
def test_amx_candidates_only_where_the_tiles_serve_the_shape():
    isa = BF16_DOT[0]
    plain = [(vt, pf, "off") for vt, pf in tune.candidates(isa, "bf16")]
    assert tune.tune_candidates(9, 3, 64, isa, "bf16", amx="emulate") == plain      # other bits: not by default
    with_pairs = tune.tune_candidates(9, 3, 64, isa, "bf16", bf16_probs=True, amx="emulate")
    assert with_pairs[-2:] == [(0, "on", "emulate"), (tune.V_PAIRS, "on", "emulate")]
    int8 = tune.tune_candidates(9, 3, 64, isa, "int8", amx="emulate")
    assert int8 == tune.tune_candidates(9, 3, 64, isa, "int8") + [(int8[0][0], "on", "emulate")]
    for shape, dtype in (((9, 3, 64), "fp32"), ((4, 4, 64), "bf16"), ((9, 3, 80), "bf16"), ((9, 3, 96), "int8")):
        assert tune.tune_candidates(*shape, isa, dtype, amx="emulate") == tune.tune_candidates(*shape, isa, dtype), shape
    assert tune.label(0, "on", "on") == "token-major/pf/amx" and tune.label(0, "on", "emulate") == "token-major/pf/amx-emulate"


@needs_bf16_dot
def test_the_tune_times_the_tiles_and_the_store_runs_its_pick(monkeypatch):
    """The tiles (here emulated: far slower, so never picked) are timed beside the rest; a pick of
    the tiles reaches the store the R-worker serves from."""
    isa = BF16_DOT[0]
    ch = tune.tune_kernel(8, 2, 64, "bf16", threads=2, isa=isa, working_set_bytes=2 << 20, rounds=1,
                          bf16_probs=True, amx="emulate")
    assert {"token-major/pf/amx-emulate", "pairs/pf/amx-emulate"} <= set(ch.gbps)
    cands = tune.tune_candidates(8, 2, 64, isa, "bf16", bf16_probs=True, amx="emulate")
    assert (ch.v_tile, ch.prefetch, ch.amx) == tune.pick({c: ch.gbps[tune.label(*c)] for c in cands}, cands, 0.02)
    picked = tune.KernelChoice(tune.V_PAIRS, "on", True, amx="emulate")
    monkeypatch.setattr(tune, "choose_kernel", lambda *a, **kw: picked)
    store, kernel = tune.open_tuned_store(2, 8, 2, 64, "bf16", 1, 64 << 20, bf16_probs=True)
    assert (store.v_tile, store.amx) == (tune.V_PAIRS, "emulate") and "AMX tiles emulate" in kernel.describe()


def test_amx_here_names_why_the_tiles_are_not_timed(monkeypatch):
    """On a CPU without AMX nothing to say; with AMX, FASTDECODE_AMX forcing a mode or the kernel
    refusing the tile state is named (the start-up line carries it), AVX-512 kept."""
    monkeypatch.delenv("FASTDECODE_AMX", raising=False)
    if "amx-bf16" not in isa_mod.cpu_features():
        assert tune.amx_here() == ("off", "")
        feats = isa_mod.cpu_features() | {"amx-bf16", "amx-tile"}
        monkeypatch.setattr(isa_mod, "cpu_features", lambda: feats)
        mode, why = tune.amx_here()         # the build's own cpuid check finds no AMX: not usable
        assert mode == "off" and "AMX tiles not usable" in why and "AVX-512 kept" in why
    monkeypatch.setenv("FASTDECODE_AMX", "0")
    if "amx-bf16" in isa_mod.cpu_features():
        assert tune.amx_here() == ("off", "AMX tiles forced by FASTDECODE_AMX=0, not timed")
