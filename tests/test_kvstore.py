"""KVStore: every ISA path this host can run against a float64 numpy reference: correctness,
paging and reuse, determinism.

Run paths by loading each module (KVStore(..., isa=...)), not only the default one.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from kernel_ref import (  # noqa: E402
    as_f32,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    fp32_tolerance,
    quantize,
)
from kvstore_cases import DTYPES, ISAS, Mirror, check, open_store, rand  # noqa: E402

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
