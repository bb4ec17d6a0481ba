"""KVStore's limits and variants: capacity and bad inputs, V layouts, AMX scores, and its threads
(idle workers sleep, calls release the GIL)."""
from __future__ import annotations

import math
import os
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from kernel_ref import (  # noqa: E402
    f32_to_bf16_bits,
)
from kvstore_cases import BF16_DOT_ISAS, DTYPES, ISAS, Mirror, check, open_store, rand  # noqa: E402

from rworker import KVStore  # noqa: E402
from rworker import isa as isa_mod  # noqa: E402
from rworker.kvstore import KVCapacityError  # noqa: E402

# ---------------------------------------------------------------------------------------------
# capacity and errors


def test_capacity_error_stores_nothing():
    Hkv, D = 2, 64
    probe = KVStore(1, Hkv, D, "bf16", threads=1)
    P = probe.page_tokens
    page = 2 * Hkv * P * D * 2
    store = KVStore(1, Hkv, D, "bf16", threads=1, capacity_bytes=3 * page)

    def z(n):
        return np.zeros((n, Hkv, D), np.float32)

    store.append(0, [1] * P, z(P), z(P))                  # 1 page
    store.append(0, [2] * (2 * P), z(2 * P), z(2 * P))    # 2 pages
    assert store.bytes_used() == 3 * page
    with pytest.raises(KVCapacityError) as e:
        store.append(0, [1, 3], z(2), z(2))               # needs 2 more pages: refused as a whole
    assert isinstance(e.value, MemoryError)
    assert store.num_tokens(1) == P and store.num_tokens(3) == 0 and store.num_seqs() == 2
    assert store.bytes_used() == 3 * page
    with pytest.raises(KVCapacityError):
        store.append_attend(0, [1], np.zeros((1, Hkv, D), np.float32), z(1), z(1))
    assert store.num_tokens(1) == P
    store.free(2)
    store.append(0, [1, 3], z(2), z(2))
    assert store.num_tokens(1) == P + 1 and store.num_tokens(3) == 1


def test_reserve_never_passes_the_capacity_after_a_trim():
    """reserve trims extent slack when short of room; the trim may give back the reserving
    sequence's own slack, so what it still needs is counted again after the trim."""
    page = KVStore(1, 1, 16, "fp32", threads=1).page_bytes
    st = KVStore(1, 1, 16, "fp32", threads=1, capacity_bytes=16 * page)
    st.extent_pages = 8
    z = lambda n: np.zeros((n, 1, 16), np.float32)  # noqa: E731
    st.append(0, [1], z(1), z(1))                    # an 8-page extent: 7 pages of slack
    st.append(0, [2] * 256, z(256), z(256))          # 16 of 16 pages in use
    took = st.reserve([1], [12 * 32])                # 12 pages for sequence 1: 4 past the capacity
    assert st.bytes_used() <= 16 * page
    assert not took and st.num_tokens(1) == 1 and st.num_tokens(2) == 256


def test_bad_inputs_raise_value_error():
    Hkv, D = 2, 64
    st = KVStore(2, Hkv, D, "bf16", threads=1)
    k = np.zeros((3, Hkv, D), np.float32)
    st.append(0, [0, 1, 2], k, k)
    q = np.zeros((3, 2 * Hkv, D), np.float32)
    bad = [
        lambda: st.append(0, [0, 1, 2], k.astype(np.float64), k.astype(np.float64)),   # dtype
        lambda: st.append(0, [0, 1, 2], k[:, :1], k[:, :1]),                            # heads
        lambda: st.append(0, [0, 1], k, k),                                             # n mismatch
        lambda: st.append(0, [0, 1, 2], k, k.astype(np.uint16)),                        # k/v dtypes differ
        lambda: st.append(5, [0, 1, 2], k, k),                                          # layer
        lambda: st.append(-1, [0, 1, 2], k, k),
        lambda: st.append(0, [0.5, 1, 2], k, k),                                        # float ids
        lambda: st.attend(0, [0, 1, 7], q),                                             # unknown id
        lambda: st.attend(1, [0, 1, 2], q),                                             # no tokens at layer 1
        lambda: st.attend(0, [0, 1, 2], q[:, :3]),                                      # Hq % Hkv
        lambda: st.attend(0, [0, 1, 2], q[:, :, :32]),                                  # head_dim
        lambda: st.attend(0, [0, 1, 2], q[:, ::2]),                                     # not contiguous
        lambda: st.attend(0, [0, 1, 2], q, out=np.empty(q.shape, np.float64)),         # out dtype
        lambda: st.attend(0, [0, 1, 2], q, out=np.empty((3, 2, D), np.float32)),       # out shape
        lambda: st.attend(9, [0, 1, 2], q),
        lambda: KVStore(1, 2, 64, "int4"),
        lambda: KVStore(0, 2, 64),
        lambda: KVStore(1, 2, 64, threads=0),
    ]
    for i, f in enumerate(bad):
        with pytest.raises(ValueError):
            f()
            pytest.fail(f"case {i} did not raise")
    assert st.num_tokens(0) == 1                          # failed calls stored nothing


def test_accounting():
    st = KVStore(32, 8, 128, "bf16", threads=1)
    assert st.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert st.bytes_used() == 0 and st.num_tokens(0) == 0
    z = np.zeros((1, 8, 128), np.uint16)
    st.append(3, [42], z, z)
    assert st.num_tokens(42, layer=3) == 1 and st.num_tokens(42, layer=0) == 0
    page = 8 * 2 * st.page_tokens * 128 * 2                          # one page per head of one layer
    assert st.bytes_committed() == page                              # what the token needs
    assert st.bytes_used() == st.extent_pages * page                 # an extent: no capacity, so room
    assert st.bytes_reserved() >= st.bytes_used()
    assert st.scale == pytest.approx(1 / math.sqrt(128))
    assert st.isa in ISAS and "KVStore(" in repr(st)


@pytest.mark.parametrize("isa", [i for i in ISAS if "+vt" in i])
@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 72, 80, 128])          # 72, 80: a 16-dim last tile
def test_v_layouts_give_bitwise_equal_outputs(isa, kv_dtype, D):
    """The tiled V layout reads the same values in the same order as token-major rows: the
    outputs must agree to the bit (so the numpy reference checks above cover both)."""
    name, vt = isa.split("+vt")
    rng = np.random.default_rng(D)
    Hkv, g, n = 2, 4, 3
    lens = [1, 63, 700]                                    # 700: split-KV chunks
    stores = [KVStore(1, Hkv, D, kv_dtype, threads=2, isa=name, v_tile=t) for t in (None, int(vt))]
    assert [st.v_tile for st in stores] == [isa_mod.load(name).V_TILE, int(vt)]
    for sid, L in enumerate(lens):
        k, v = rand(rng, (L, Hkv, D)), rand(rng, (L, Hkv, D))
        for st in stores:
            st.append(0, [sid] * L, k, v)
    q = rand(rng, (n, Hkv * g, D))
    a, b = (st.attend(0, list(range(n)), q) for st in stores)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # decode appends land in the right tile rows too
    k1, v1 = rand(rng, (n, Hkv, D)), rand(rng, (n, Hkv, D))
    a, b = (st.append_attend(0, list(range(n)), q, k1, v1) for st in stores)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_v_tile_must_be_a_layout_of_the_build(monkeypatch):
    mod = isa_mod.load(None)
    bad = 7
    with pytest.raises(ValueError, match="v_tile=7"):
        KVStore(1, 1, 64, v_tile=bad)
    monkeypatch.setenv("FASTDECODE_VTILE", "7")            # a measurement knob: ignored where absent
    assert KVStore(1, 1, 64).v_tile == mod.V_TILE


@pytest.mark.parametrize("isa", [i for i in ISAS if i.endswith("+amx")])
@pytest.mark.parametrize("g,D,takes_amx", [(4, 128, True), (3, 64, True), (16, 96, True), (2, 64, True),
                                           (20, 64, True), (1, 128, False), (4, 80, False)])
def test_amx_scores_where_they_apply(isa, g, D, takes_amx):
    """The AMX path serves bf16 KV with bf16 queries wherever an item has two query rows or more
    (GQA ratios past 16 in several tile products) and Dp % 32 == 0 (its outputs then differ from the
    vdpbf16ps path in the order of fp32 sums, within the fp32 bound against the reference); every
    other call (MHA rows alone, other head dims, fp32 queries) keeps the vdpbf16ps path to the bit."""
    rng = np.random.default_rng(g * 100 + D)
    Hkv = 2
    stores = [open_store(1, Hkv, D, "bf16", threads=2, isa=i) for i in (isa.split("+")[0], isa)]
    assert [st.amx for st in stores] == ["off", "emulate"]
    mirror = Mirror()
    lengths = [1, 31, 33, 700, 1100]                 # partial pages, split-KV chunks
    for sid, n in enumerate(lengths):
        k, v = rand(rng, (n, Hkv, D)), rand(rng, (n, Hkv, D))
        for st in stores:
            st.append(0, [sid] * n, k, v)
        mirror.add(0, [sid] * n, k, v)
    ids = list(range(len(lengths)))
    q = f32_to_bf16_bits(rand(rng, (len(ids), Hkv * g, D)))
    ref_path, amx_path = (st.attend(0, ids, q) for st in stores)
    check(stores[1], mirror, 0, ids, q, amx_path, "bf16")
    assert np.array_equal(ref_path, amx_path) != takes_amx
    qf = rand(rng, (len(ids), Hkv * g, D))             # fp32 queries: never the AMX path
    assert np.array_equal(*(st.attend(0, ids, qf) for st in stores))


def test_amx_modes_and_errors(monkeypatch):
    """amx: "on" only where the CPU has AMX-BF16, "emulate" only where the AVX512-BF16 scores run;
    FASTDECODE_AMX asks every store, and falls back with a warning where it cannot."""
    has_hw = "amx-bf16" in isa_mod.cpu_features() and "avx512" in isa_mod.available_isas()
    with pytest.raises(ValueError, match="amx must be one of"):
        KVStore(1, 1, 64, isa="portable", amx="fast")
    with pytest.raises(ValueError, match="portable build has no AMX"):
        KVStore(1, 1, 64, isa="portable", amx="emulate")
    assert KVStore(1, 1, 64, isa="portable", amx=False).amx == "off"
    if BF16_DOT_ISAS:
        st = KVStore(1, 1, 64, isa=BF16_DOT_ISAS[0], amx="emulate")
        assert st.amx == "emulate" and "amx=emulate" in repr(st)
        st.amx = False
        assert st.amx == "off"
    if not has_hw:
        for isa in BF16_DOT_ISAS:
            with pytest.raises(ValueError, match="no AMX-BF16"):
                KVStore(1, 1, 64, isa=isa, amx="on")
    monkeypatch.setenv("FASTDECODE_AMX", "sometimes")
    with pytest.raises(ValueError, match="FASTDECODE_AMX must be"):
        KVStore(1, 1, 64, isa="portable")
    monkeypatch.setenv("FASTDECODE_AMX", "on")
    if has_hw:
        assert KVStore(1, 1, 64, isa="avx512").amx == "on"
    else:
        with pytest.warns(RuntimeWarning, match="FASTDECODE_AMX=on: .*stay off"):
            assert KVStore(1, 1, 64, isa="portable").amx == "off"
    monkeypatch.setenv("FASTDECODE_AMX", "emulate")
    for isa in BF16_DOT_ISAS:
        assert KVStore(1, 1, 64, isa=isa).amx == "emulate"


# ---------------------------------------------------------------------------------------------
# threads: idle workers sleep; calls release the GIL


def _cpu_seconds():
    t = os.times()
    return t.user + t.system


def test_idle_threads_do_not_spin():
    rng = np.random.default_rng(0)
    st = KVStore(1, 2, 64, "bf16", threads=max(2, os.cpu_count() or 2))
    st.append(0, [0] * 4000, rand(rng, (4000, 2, 64)), rand(rng, (4000, 2, 64)))
    st.attend(0, [0], rand(rng, (1, 4, 64)))                # workers started and now idle
    time.sleep(0.05)
    c0 = _cpu_seconds()
    time.sleep(0.5)
    used = _cpu_seconds() - c0
    assert used < 0.1, f"process used {used:.3f} s of CPU while idle for 0.5 s: worker threads spin"


def test_gil_released_during_kernel():
    """Another Python thread runs while attend is inside C++ (the lead runs MPI progress there)."""
    rng = np.random.default_rng(0)
    st = KVStore(1, 2, 128, "fp32", threads=1, isa="portable")
    n = 20_000
    st.append(0, [0] * n, rand(rng, (n, 2, 128)), rand(rng, (n, 2, 128)))
    rows = 32                          # the sequence 32 times in one call: ~0.1-0.3 s of kernel (one pass
    q = rand(rng, (rows, 8, 128))      # takes a few ms on a Zen 5 core, too short for the other thread to wake)
    started, done, ticks = threading.Event(), threading.Event(), [0]

    def kernel():
        started.set()
        st.attend(0, [0] * rows, q)    # well under the switch interval below
        done.set()

    def count():
        started.wait()
        while not done.is_set():
            ticks[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)       # no forced GIL hand-over during the call: the counter runs only if C++ lets go
    try:
        threads = [threading.Thread(target=count), threading.Thread(target=kernel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert done.is_set() and ticks[0] > 0
