"""KVStore: every ISA path this host can run against a float64 numpy reference.

Run paths by loading each module (KVStore(..., isa=...)), not only the default one.
"""
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
    as_f32,
    attention_ref,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    fp32_tolerance,
    quantize,
    tolerance,
)

from rworker import KVStore  # noqa: E402
from rworker import isa as isa_mod  # noqa: E402
from rworker.kvstore import KVCapacityError  # noqa: E402

# every path this CPU runs, and the AVX-512 code emulated through SIMDe where it was built
# (rworker.isa.EMULATED: the AVX-512 branch's logic is then tested on CPUs without AVX-512 too)
# A build with a second V layout under measurement (V_TILE_ALT, simd.h) is tested in both:
# "<isa>+vt<N>" opens its stores with v_tile=N.
# The AMX scores (csrc/avx512/amx.h) replace the AVX512-BF16 ones: "<isa>+amx" opens its stores
# with amx="emulate" wherever that path runs, "<isa>+amxhw" with the instructions on an AMX CPU.
_BASE = [i for i in isa_mod.available_isas() if i in ("portable", "avx2", "avx512")] + isa_mod.emulated_isas()
_DP = [i for i in _BASE if i == "avx512emu" or (i == "avx512" and "avx512bf16" in isa_mod.cpu_features())]
ISAS = (_BASE + [f"{i}+vt{isa_mod.load(i).V_TILE_ALT}" for i in _BASE
                 if isa_mod.load(i).V_TILE_ALT != isa_mod.load(i).V_TILE]
        + [f"{i}+amx" for i in _DP]
        + [f"{i}+amxhw" for i in _DP if i == "avx512" and "amx-bf16" in isa_mod.cpu_features()])
DTYPES = ["fp32", "bf16", "fp16"]


def open_store(*args, isa: str, **kw) -> KVStore:
    """KVStore on one ISA path ("avx512emu", or "avx512emu+vt32" for its second V layout, 32-dim
    tiles, or "avx512+amx" for the emulated AMX scores, "avx512+amxhw" for the instructions)."""
    name, _, amx = isa.partition("+amx")        # "avx512+amxhw" -> "avx512", "hw"
    name, _, vt = name.partition("+vt")
    amx_mode = None if "+amx" not in isa else "on" if amx == "hw" else "emulate"
    return KVStore(*args, isa=name, v_tile=int(vt) if vt else None, amx=amx_mode, **kw)


def rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


class Mirror:
    """What a store should hold: per (seq, layer) the list of appended k, v rows (inputs as given)."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, layer, ids, k, v):
        for i, s in enumerate(np.asarray(ids).tolist()):
            self.k.setdefault((s, layer), []).append(as_f32(k[i]))
            self.v.setdefault((s, layer), []).append(as_f32(v[i]))

    def kv(self, s, layer):
        return np.stack(self.k[(s, layer)]), np.stack(self.v[(s, layer)])

    def free(self, s):
        for key in [key for key in self.k if key[0] == s]:
            del self.k[key], self.v[key]


def check(store, mirror, layer, ids, q, o, kv_dtype):
    """o against the reference on stored values (fp32 tolerance) and on inputs (dtype tolerance)."""
    for i, s in enumerate(ids):
        k, v = mirror.kv(s, layer)
        kq, vq = quantize(k, kv_dtype), quantize(v, kv_dtype)
        qi = as_f32(q[i]).astype(np.float64)
        got = as_f32(o[i]).astype(np.float64)
        ref_q = attention_ref(qi, kq, vq, store.scale)
        extra = np.abs(ref_q) * 2.0**-8 if o.dtype == np.uint16 else 0.0     # bf16 output: one more rounding
        tol_q = fp32_tolerance(qi, kq, vq, store.scale)[:, None] + extra
        err = np.abs(got - ref_q)
        assert (err <= tol_q).all(), f"seq {s} len {len(k)}: max err {err.max():.3g} vs tol {tol_q.min():.3g} (stored values)"
        ref = attention_ref(qi, k.astype(np.float64), v.astype(np.float64), store.scale)
        tol = tolerance(qi, k, v, store.scale, kv_dtype)[:, None] + extra
        assert (np.abs(got - ref) <= tol).all(), f"seq {s}: err {np.abs(got - ref).max():.3g} > dtype tol"


# ---------------------------------------------------------------------------------------------
# correctness


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype,q_bf16", [("fp32", False), ("bf16", False), ("fp16", False), ("bf16", True)])
def test_lengths_mixed_batch(isa, kv_dtype, q_bf16):
    """Lengths 1..10000 (page and chunk edges) in one batch, prefill + decode appends, GQA 4.

    q_bf16: queries as bf16 bits (with bf16 KV on an AVX512-BF16 CPU: the vdpbf16ps path)."""
    rng = np.random.default_rng(1)
    Hkv, g, D = 2, 4, 128
    lengths = [1, 2, 63, 64, 65, 4095, 4096, 10000]
    store = open_store(2, Hkv, D, kv_dtype, threads=2, isa=isa)
    mirror = Mirror()
    ids = list(range(100, 100 + len(lengths)))
    for layer in range(2):
        for s, n in zip(ids, lengths):
            pre = n - min(n, 3)                         # prompt rows (same id repeated) ...
            if pre:
                k, v = rand(rng, (pre, Hkv, D)), rand(rng, (pre, Hkv, D))
                store.append(layer, np.full(pre, s), k, v)
                mirror.add(layer, [s] * pre, k, v)
        for step in range(3):                           # ... then decode rows, one per sequence
            live = [s for s, n in zip(ids, lengths) if n - min(n, 3) + step < n]
            k, v = rand(rng, (len(live), Hkv, D)), rand(rng, (len(live), Hkv, D))
            store.append(layer, live, k, v)
            mirror.add(layer, live, k, v)
    for s, n in zip(ids, lengths):
        assert store.num_tokens(s, 1) == n
    q = rand(rng, (len(ids), Hkv * g, D))
    if q_bf16:
        q = f32_to_bf16_bits(q)
    for layer in range(2):
        o = store.attend(layer, ids, q)
        assert o.dtype == np.float32 and o.shape == q.shape
        check(store, mirror, layer, ids, q, o, kv_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 6, 8, 16])
@pytest.mark.parametrize("D", [64, 80, 96, 128, 33])
def test_shapes(isa, g, D):
    """GQA ratios x head dims (33: the generic padded path), random lengths, dtype cycles."""
    kv_dtype = DTYPES[(g + D) % 3]
    rng = np.random.default_rng(g * 1000 + D)
    Hkv = 1 + (g + D) % 3
    store = open_store(1, Hkv, D, kv_dtype, threads=2, isa=isa)
    mirror = Mirror()
    lengths = rng.integers(1, 700, size=4).tolist()
    for s, n in enumerate(lengths):
        k, v = rand(rng, (n, Hkv, D)), rand(rng, (n, Hkv, D))
        store.append(0, [s] * n, k, v)
        mirror.add(0, [s] * n, k, v)
    ids = list(range(len(lengths)))
    q = rand(rng, (len(ids), Hkv * g, D))
    check(store, mirror, 0, ids, q, store.attend(0, ids, q), kv_dtype)
    qb = f32_to_bf16_bits(q)                                 # bf16 queries (dot-product path)
    check(store, mirror, 0, ids, qb, store.attend(0, ids, qb), kv_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_large_scores_no_overflow(isa, kv_dtype):
    """Scores of +-1e4: exp() of them overflows fp32, the online softmax must not."""
    rng = np.random.default_rng(7)
    Hkv, D, n = 2, 64, 1500
    store = open_store(1, Hkv, D, kv_dtype, threads=2, isa=isa)
    k = rand(rng, (n, Hkv, D), 30.0)
    v = rand(rng, (n, Hkv, D), 100.0)
    store.append(0, [5] * n, k, v)
    mirror = Mirror()
    mirror.add(0, [5] * n, k, v)
    q = rand(rng, (1, 2 * Hkv, D), 30.0)
    o = store.attend(0, [5], q)
    assert np.isfinite(o).all()
    check(store, mirror, 0, [5], q, o, kv_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_single_token_returns_stored_value(isa, kv_dtype):
    """One token: softmax weight is exactly 1, so o is bitwise the stored (rounded) v.

    Checks the conversions into the store: fp32 -> bf16 / fp16 round to nearest even, as numpy."""
    rng = np.random.default_rng(3)
    Hkv, D = 3, 80
    store = open_store(1, Hkv, D, kv_dtype, threads=1, isa=isa)
    v = rand(rng, (4, Hkv, D)) * np.float32(1000)
    v[0, 0, :4] = [65519.0, 1e-6, -3e-8, 1.0 + 2.0**-8]   # fp16 max/subnormals, a bf16 tie
    k = rand(rng, (4, Hkv, D))
    store.append(0, [0, 1, 2, 3], k, v)
    o = store.attend(0, [0, 1, 2, 3], rand(rng, (4, Hkv, D)))
    np.testing.assert_array_equal(o, quantize(v, kv_dtype).astype(np.float32))


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_bits_in_and_out(isa):
    """uint16 inputs are bf16 bits; a uint16 `out` receives bf16 bits rounded to nearest even."""
    rng = np.random.default_rng(11)
    Hkv, g, D, n = 2, 2, 64, 300
    store = open_store(1, Hkv, D, "bf16", threads=2, isa=isa)
    k = f32_to_bf16_bits(rand(rng, (n, Hkv, D)))
    v = f32_to_bf16_bits(rand(rng, (n, Hkv, D)))
    store.append(0, [9] * n, k, v)
    mirror = Mirror()
    mirror.add(0, [9] * n, k, v)
    q = f32_to_bf16_bits(rand(rng, (1, Hkv * g, D)))
    o32 = store.attend(0, [9], q)
    o16 = store.attend(0, [9], q, out=np.empty(q.shape, np.uint16))
    assert o16.dtype == np.uint16
    np.testing.assert_array_equal(o16, f32_to_bf16_bits(o32))   # same kernel, rounded on the way out
    check(store, mirror, 0, [9], q, o16, "bf16")
    # float32 q holding the same values: same result up to fp32 rounding (bf16 q may take the
    # AVX512-BF16 dot-product path, float32 q the FMA path)
    o_f = store.attend(0, [9], bf16_bits_to_f32(q))
    k64, v64 = quantize(k, "bf16"), quantize(v, "bf16")
    tol = 2 * fp32_tolerance(as_f32(q[0]).astype(np.float64), k64, v64, store.scale)[:, None]
    assert (np.abs(o_f[0] - o32[0]) <= tol).all()


@pytest.mark.parametrize("isa", ISAS)
def test_append_attend_equals_append_then_attend(isa):
    rng = np.random.default_rng(5)
    Hkv, g, D = 2, 4, 64
    a = open_store(1, Hkv, D, "bf16", threads=2, isa=isa)
    b = open_store(1, Hkv, D, "bf16", threads=2, isa=isa)
    ids = [3, 1, 4]
    for s, n in zip(ids, [10, 600, 1]):
        k, v = rand(rng, (n, Hkv, D)), rand(rng, (n, Hkv, D))
        a.append(0, [s] * n, k, v)
        b.append(0, [s] * n, k, v)
    for _ in range(3):
        q, k, v = rand(rng, (3, Hkv * g, D)), rand(rng, (3, Hkv, D)), rand(rng, (3, Hkv, D))
        o1 = a.append_attend(0, ids, q, k, v)
        b.append(0, ids, k, v)
        o2 = b.attend(0, ids, q)
        np.testing.assert_array_equal(o1, o2)
    assert a.num_tokens(1) == 603


# ---------------------------------------------------------------------------------------------
# paging, reuse, determinism


@pytest.mark.parametrize("isa", ISAS)
def test_interleaved_appends_and_frees_reuse_pages(isa):
    rng = np.random.default_rng(2)
    Hkv, D = 2, 64
    store = open_store(2, Hkv, D, "fp16", threads=2, isa=isa)
    mirror = Mirror()
    live = {}
    next_id = 0
    reserved_after_warmup = None
    for step in range(60):
        if step % 7 == 3 and live:                               # free the oldest sequence
            s = min(live)
            assert store.free(s)
            mirror.free(s)
            del live[s]
        if len(live) < 4:                                        # admit a new one with a prompt
            n = int(rng.integers(1, 200))
            for layer in range(2):
                k, v = rand(rng, (n, Hkv, D)), rand(rng, (n, Hkv, D))
                store.append(layer, [next_id] * n, k, v)
                mirror.add(layer, [next_id] * n, k, v)
            live[next_id] = n
            next_id += 1
        ids = sorted(live)
        for layer in range(2):                                   # one decode token each, then attend
            q, k, v = rand(rng, (len(ids), 2 * Hkv, D)), rand(rng, (len(ids), Hkv, D)), rand(rng, (len(ids), Hkv, D))
            mirror.add(layer, ids, k, v)
            o = store.append_attend(layer, ids, q, k, v)
            check(store, mirror, layer, ids, q, o, "fp16")
        if step == 20:
            reserved_after_warmup = store.bytes_reserved()
    assert store.bytes_reserved() == reserved_after_warmup        # freed pages were reused
    assert not store.free(10**9)                                  # unknown id: False, no error
    assert store.num_tokens(10**9) == 0
    used = store.bytes_used()
    for s in list(live):
        store.free(s)
    assert store.bytes_used() == 0 < used


@pytest.mark.parametrize("isa", ISAS)
def test_determinism_batch_threads_history(isa):
    """A sequence's output is bitwise the same alone, in a batch, with 1 or 2 threads, after churn."""
    rng = np.random.default_rng(4)
    Hkv, g, D = 2, 4, 128
    n_target = 5000                                        # several split-KV chunks
    k, v = rand(rng, (n_target, Hkv, D)), rand(rng, (n_target, Hkv, D))
    q = rand(rng, (1, Hkv * g, D))

    def run(threads, others, churn):
        st = open_store(1, Hkv, D, "bf16", threads=threads, isa=isa)
        r = np.random.default_rng(99)
        if churn:                                          # other sequences come and go first
            for s in range(20):
                n = int(r.integers(1, 300))
                st.append(0, [1000 + s] * n, rand(r, (n, Hkv, D)), rand(r, (n, Hkv, D)))
                if s % 3 == 0:
                    st.free(1000 + s)
        half = n_target // 2                               # target arrives in two prompt pieces,
        st.append(0, [7] * half, k[:half], v[:half])      # interleaved with the others' appends
        for s in range(others):
            n = int(r.integers(1, 3000))
            st.append(0, [100 + s] * n, rand(r, (n, Hkv, D)), rand(r, (n, Hkv, D)))
        st.append(0, [7] * (n_target - half), k[half:], v[half:])
        ids = [7] + [100 + s for s in range(others)]
        qs = np.concatenate([q, rand(r, (others, Hkv * g, D))])
        perm = r.permutation(len(ids))
        out = st.attend(0, np.array(ids)[perm], qs[perm])
        return out[np.argsort(perm)][0]

    base = run(1, 0, False)
    for threads, others, churn in [(2, 0, False), (1, 6, True), (2, 6, True), (2, 13, False), (3, 2, True)]:
        np.testing.assert_array_equal(run(threads, others, churn), base)


@pytest.mark.parametrize("isa", ISAS)
def test_threads_property(isa):
    rng = np.random.default_rng(8)
    store = open_store(1, 1, 64, "fp32", threads=1, isa=isa)
    store.append(0, [0] * 900, rand(rng, (900, 1, 64)), rand(rng, (900, 1, 64)))
    q = rand(rng, (1, 2, 64))
    o1 = store.attend(0, [0], q)
    store.threads = 2
    assert store.threads == 2
    np.testing.assert_array_equal(store.attend(0, [0], q), o1)
    with pytest.raises(ValueError):
        store.threads = 0


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
        lambda: KVStore(1, 2, 64, "int8"),
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
                                           (1, 128, False), (4, 80, False), (20, 64, False)])
def test_amx_scores_where_they_apply(isa, g, D, takes_amx):
    """The AMX path serves bf16 KV with bf16 queries for GQA ratios 2..16 and Dp % 32 == 0 (its
    outputs then differ from the vdpbf16ps path in the order of fp32 sums, within the fp32 bound
    against the reference); every other call keeps the vdpbf16ps path to the bit."""
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
    if _DP:
        st = KVStore(1, 1, 64, isa=_DP[0], amx="emulate")
        assert st.amx == "emulate" and "amx=emulate" in repr(st)
        st.amx = False
        assert st.amx == "off"
    if not has_hw:
        for isa in _DP:
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
    for isa in _DP:
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
