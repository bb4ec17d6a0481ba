"""One sequence's KV out of a store and back in (KVStore.export_seq / import_seq / layout_signature,
csrc/avx512/kv_blob.h): a stopped job saves its in-flight KV and a rerun loads it instead of
recomputing it.

An imported sequence is the exported one: attend gives the exporter's bits (np.array_equal, never
numbers written down here), exporting it again gives the same blob, and appends continue it and keep
giving the bits the exporting store gives after the same appends (the blobs of two stores are not
compared after appends: the slots of a last page past its tokens hold what the page held before).
On every ISA build, KV dtype and V layout (tiles, token pairs); a windowed layer's dead pages are
not in the blob and die on as appends pass; a forked sequence's shared pages come back as its own;
the accounting stays exact (bytes_committed equals the walk). A blob past the capacity is refused
with nothing changed; a held id, a truncated, foreign, newer or malformed blob and a store of
another geometry raise ValueError naming what differs; an id the store does not hold raises KeyError.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from kvstore_cases import BASE_ISAS, ISAS  # noqa: E402
from prefix_cases import PAIRS, ok_for, open_path  # noqa: E402

from rworker import KVStore  # noqa: E402

PT = 32                    # tokens per page (paging.h)
L, HKV, G, D = 2, 2, 2, 80     # D = 80: padded to 80, the last V tile of 32-dim tiles narrower
PATHS = [p for p in ISAS + PAIRS if "+amx" not in p]       # AMX changes the products, not the pages
CASES = [(p, kv) for p in PATHS for kv in ("fp32", "bf16", "fp16", "int8") if ok_for(p, kv)]


def header_bytes(layers):
    return 16 + 36 + 4 * layers + 8 * layers


def kv(rng, n, d=D):
    return rng.standard_normal((n, HKV, d)).astype(np.float32), rng.standard_normal((n, HKV, d)).astype(np.float32)


def grow(stores, layer, sid, n, seed):
    """The same n rows appended to (store, id) of every pair in stores."""
    k, v = kv(np.random.default_rng(seed), n, stores[0][0].head_dim)
    for st, i in stores:
        st.append(layer, [i] * n, k, v)


def queries(seed, d=D):
    """An fp32 and a bf16 (uint16 bits) query block for one row."""
    q = np.random.default_rng(seed).standard_normal((1, HKV * G, d)).astype(np.float32)
    return q, (q.view(np.uint32) >> 16).astype(np.uint16)


def assert_same(stores, seed=0):
    """Every (store, id) of stores gives the first one's bits at every layer, for fp32 and bf16 queries."""
    for layer in range(stores[0][0].num_layers):
        for q in queries(seed + layer, stores[0][0].head_dim):
            outs = [st.attend(layer, [i], q) for st, i in stores]
            for (st, i), o in zip(stores[1:], outs[1:]):
                assert np.array_equal(o, outs[0]), f"layer {layer} {st.isa} seq {i}: other bits than the exporter's"


def exact(*stores):
    for st in stores:
        assert st.bytes_committed() == st._st.bytes_committed_walk()
        assert st.bytes_committed() <= st.bytes_used()


def holding(path, kv_dtype, **kw):
    """A store on `path` holding seq 1 (77 tokens at layer 0, 45 at layer 1, appended in interleaved
    calls with seq 2) and seq 2."""
    st = open_path(L, HKV, D, kv_dtype, path, threads=1, **kw)
    k, v = kv(np.random.default_rng(5), 73)
    st.append(0, [1] * 40 + [2] * 33, k, v)
    grow([(st, 1)], 0, 1, 37, 6)
    k, v = kv(np.random.default_rng(7), 78)
    st.append(1, [2] * 33 + [1] * 45, k, v)
    return st


@pytest.mark.parametrize("path,kv_dtype", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_round_trip_gives_the_exporters_bits_and_appends_continue_it(path, kv_dtype):
    a = holding(path, kv_dtype)
    blob = a.export_seq(1)
    assert blob[:4] == b"FDKV" and len(blob) == header_bytes(L) + (3 + 2) * HKV * a.page_bytes
    b = open_path(L, HKV, D, kv_dtype, path, threads=1)
    assert b.layout_signature() == a.layout_signature() == blob[16:16 + len(a.layout_signature())]
    assert b.import_seq(7, blob) and a.import_seq(8, bytearray(blob))     # another store, and the same one
    assert [b.num_tokens(7, layer) for layer in range(L)] == [77, 45] == [a.num_tokens(8, layer) for layer in range(L)]
    assert b.export_seq(7) == blob == a.export_seq(8)
    pairs = [(a, 1), (b, 7), (a, 8)]
    assert_same(pairs)
    exact(a, b)
    grow(pairs, 0, None, 40, 11)                        # 77 -> 117: over a page edge
    grow(pairs, 1, None, 19, 12)                        # 45 -> 64: fills the page
    for step in range(3):                               # decode steps, fused
        k, v = kv(np.random.default_rng(20 + step), 1)
        q, _ = queries(30 + step)
        outs = [st.append_attend(1, [i], q, k, v) for st, i in pairs]
        assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    assert_same(pairs, seed=40)
    assert all(st.num_tokens(i, 1) == 67 for st, i in pairs)
    exact(a, b)
    assert b.free(7) and b.bytes_used() == 0 and b.num_seqs() == 0


@pytest.mark.parametrize("path", BASE_ISAS)
def test_windowed_layers_carry_only_live_pages_and_keep_dying(path):
    """A layer of window 40 holding 300 tokens has 8 pages per head dead: not in the blob; an import
    holds only the live ones and gives back pages as appends pass them, as the exporter does."""
    windows = (0, 40, 100)
    a = open_path(3, HKV, D, "bf16", path, threads=1, windows=windows)
    for layer in range(3):
        for c in range(6):                              # prefill in chunks, then a few decode rows
            grow([(a, 3)], layer, 3, 50, 100 * layer + c)
    live = [10 - 0, 10 - 8, 10 - 6]                     # pages per head: ceil(300 / 32) less the dead
    blob = a.export_seq(3)
    assert len(blob) == header_bytes(3) + sum(live) * HKV * a.page_bytes
    b = open_path(3, HKV, D, "bf16", path, threads=1, windows=windows)
    assert b.import_seq(3, blob) and b.export_seq(3) == blob
    assert b.bytes_used() == b.bytes_committed() == sum(live) * HKV * b.page_bytes
    assert b.page_runs(3, 1) == HKV                     # each head's live pages one run, as an append takes them
    assert_same([(a, 3), (b, 3)])
    exact(a, b)
    for layer in range(3):
        for c in range(3):                              # 300 -> 375: more pages die at layers 1 and 2
            grow([(a, 3), (b, 3)], layer, 3, 25, 1000 + 10 * layer + c)
    assert_same([(a, 3), (b, 3)], seed=7)
    assert [b.num_tokens(3, layer) for layer in range(3)] == [375] * 3
    assert b.bytes_committed() == a.bytes_committed()
    exact(a, b)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_a_forked_sequence_comes_back_whole_with_pages_of_its_own(kv_dtype):
    path = BASE_ISAS[0]
    a = open_path(L, HKV, D, kv_dtype, path, threads=1)
    for layer in range(L):
        grow([(a, 0)], layer, 0, 200, layer)
    a.fork(0, 1, 150)                                   # 4 pages shared, a partial one copied
    for layer in range(L):
        grow([(a, 1)], layer, 1, 40, 10 + layer)
    a.fork(1, 2, 64)                                    # nested, on a page edge: 2 pages shared
    stats = a.sharing_stats()
    blobs = {i: a.export_seq(i) for i in (1, 2)}
    assert len(blobs[1]) == header_bytes(L) + L * 6 * HKV * a.page_bytes     # 190 tokens: 6 pages, shared ones too
    b = open_path(L, HKV, D, kv_dtype, path, threads=1)
    assert b.import_seq(11, blobs[1]) and b.import_seq(12, blobs[2]) and a.import_seq(21, blobs[1])
    assert b.sharing_stats()["shared_pages"] == 0 and a.sharing_stats() == stats
    assert b.export_seq(11) == blobs[1] == a.export_seq(21) and b.export_seq(12) == blobs[2]
    assert b.bytes_used() == (L * 6 + L * 2) * HKV * b.page_bytes
    assert_same([(a, 1), (b, 11), (a, 21)])             # each alone in its call: the unshared bits
    assert_same([(a, 2), (b, 12)])
    exact(a, b)
    want = [a.attend(layer, [21], queries(layer)[0]) for layer in range(L)]
    for i in (0, 1, 2):
        a.free(i)
    assert a.sharing_stats()["shared_pages"] == 0 and a.bytes_used() == L * 6 * HKV * a.page_bytes
    assert all(np.array_equal(a.attend(layer, [21], queries(layer)[0]), want[layer]) for layer in range(L))
    exact(a)


def test_an_empty_sequence_round_trips():
    """A sequence created by reserve holds no token: its blob is the header alone."""
    a = open_path(L, HKV, D, "fp16", BASE_ISAS[0], threads=1)
    assert a.reserve([4], [64])
    blob = a.export_seq(4)
    assert len(blob) == header_bytes(L)
    b = open_path(L, HKV, D, "fp16", BASE_ISAS[0], threads=1)
    assert b.import_seq(4, memoryview(blob)) and b.num_seqs() == 1 and b.bytes_used() == 0
    for layer in range(L):
        grow([(a, 4), (b, 4)], layer, 4, 33, layer)
    assert_same([(a, 4), (b, 4)])
    exact(a, b)


def snapshot(st, ids):
    return (st.num_seqs(), st.bytes_used(), st.bytes_committed(),
            [st.attend(0, [i], queries(0)[0]).tobytes() for i in ids])


def test_past_the_capacity_nothing_is_stored():
    path = BASE_ISAS[0]
    a = holding(path, "bf16")
    blob = a.export_seq(1)                              # 3 + 2 pages per head: 10 pages
    pb = a.page_bytes
    b = open_path(L, HKV, D, "bf16", path, threads=1, capacity_bytes=12 * pb)
    for layer in range(L):
        grow([(b, 9)], layer, 9, 20, layer)             # 4 pages held
    before = snapshot(b, [9])
    assert b.import_seq(5, blob) is False
    assert snapshot(b, [9]) == before and b.num_tokens(5) == 0
    with pytest.raises(KeyError):
        b.export_seq(5)
    b.free(9)
    assert b.import_seq(5, blob) and b.export_seq(5) == blob
    exact(b)


def test_other_sequences_extent_slack_is_trimmed_only_when_that_makes_room():
    path = BASE_ISAS[0]
    a = open_path(L, HKV, D, "bf16", path, threads=1)
    for layer in range(L):
        grow([(a, 1)], layer, 1, 300, layer)
    big, small = a.export_seq(1), holding(path, "bf16").export_seq(1)    # 40 and 10 pages
    pb = a.page_bytes
    b = open_path(L, HKV, D, "bf16", path, threads=1, capacity_bytes=40 * pb)
    b.extent_pages = 8
    for layer in range(L):
        grow([(b, 9)], layer, 9, 1, layer)              # an extent: 8 pages per head, 7 of them slack
    assert b.bytes_used() == 32 * pb and b.bytes_committed() == 4 * pb
    before = snapshot(b, [9])
    assert b.import_seq(5, big) is False                # 4 + 40 > 40: refused, the slack left alone
    assert snapshot(b, [9]) == before
    assert b.import_seq(5, small)                       # 32 + 10 > 40, but 4 + 10 fit once trimmed
    assert b.bytes_used() == b.bytes_committed() == 14 * pb
    assert snapshot(b, [9])[3] == before[3]
    exact(b)


def test_layout_signature_says_which_stores_take_each_others_blobs():
    path = BASE_ISAS[0]
    a = holding(path, "bf16")
    blob, sig = a.export_seq(1), a.layout_signature()
    assert isinstance(sig, bytes) and len(sig) == 36 + 4 * L
    mismatches = [
        (dict(num_layers=3), "KV blob's num_layers is 2, this store's 3"),
        (dict(num_kv_heads=1), "KV blob's num_kv_heads is 2, this store's 1"),
        (dict(head_dim=64), "KV blob's head_dim is 80, this store's 64"),
        (dict(kv_dtype="fp32"), "KV blob's kv dtype is bf16, this store's fp32"),
        (dict(kv_dtype="int8"), "KV blob's kv dtype is bf16, this store's int8"),
        (dict(windows=(0, 64)), "KV blob's window of layer 1 is 0, this store's 64"),
    ]
    for kw, msg in mismatches:
        args = dict(num_layers=L, num_kv_heads=HKV, head_dim=D, kv_dtype="bf16", threads=1, isa=a.isa) | kw
        other = KVStore(**args)
        assert other.layout_signature() != sig
        with pytest.raises(ValueError) as e:
            other.import_seq(1, blob)
        assert str(e.value) == msg and other.num_seqs() == 0
    tiles = [KVStore(L, HKV, D, "bf16", threads=1, isa=i, v_tile=t) for i in BASE_ISAS
             for t in sorted({KVStore(1, 1, 64, isa=i).v_tile, KVStore(1, 1, 64, isa=i)._mod.V_TILE_ALT})]
    for st in tiles:
        assert (st.layout_signature() == sig) == (st.v_tile == a.v_tile)
        if st.v_tile != a.v_tile:
            with pytest.raises(ValueError, match=f"^KV blob's v_tile is {a.v_tile}, this store's {st.v_tile}$"):
                st.import_seq(1, blob)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_builds_of_one_page_layout_take_each_others_blobs(kv_dtype):
    """The builds whose pages have one layout (int8 has one everywhere; the others where the V
    layouts agree) have one signature and take each other's blobs: the same K/V, outputs within
    the epilogues' rounding (not bitwise: each ISA adds in its own order)."""
    stores = {i: holding(i, kv_dtype) for i in BASE_ISAS}
    ref = stores[BASE_ISAS[0]]
    blob = ref.export_seq(1)
    for st in stores.values():
        if st.layout_signature() != ref.layout_signature():
            assert kv_dtype != "int8"
            continue
        assert st.import_seq(5, blob) and st.export_seq(5) == blob
        for layer in range(L):
            q = queries(layer)[0]
            np.testing.assert_allclose(st.attend(layer, [5], q), ref.attend(layer, [1], q), rtol=1e-4, atol=1e-5)


def le(x):
    return int(x).to_bytes(4, "little", signed=True)


def test_bad_blobs_held_ids_and_unknown_ids():
    a = holding(BASE_ISAS[0], "bf16")
    blob = a.export_seq(1)
    n = len(blob)
    lens = 16 + 36 + 4 * L                                   # layer 0's (len, dead)
    bad = [
        (blob[:-1], f"^KV blob truncated: {n - 1} bytes of the {n} its header gives$"),
        (blob[:n // 2], "^KV blob truncated"),
        (blob[:30], "^KV blob truncated"),
        (blob[:12], "^KV blob truncated"),
        (blob[:3], "^KV blob truncated: 3 bytes$"),
        (b"", "^KV blob truncated: 0 bytes$"),
        (blob + b"\0", f"^KV blob has 1 bytes past the {n} its header gives$"),
        (b"GGUF" + blob[4:], "^not a KV blob"),
        (blob[:4] + le(2) + blob[8:], "^KV blob format version 2, this build reads version 1$"),
        (blob[:lens] + le(77 + 32) + blob[lens + 4:], "^KV blob malformed: its layer lengths take"),
        (blob[:lens + 4] + le(1) + blob[lens + 8:], "^KV blob malformed: layer 0 holds 77 tokens with 1 dead pages"),
        (blob[:lens] + le(-5) + blob[lens + 4:], "^KV blob malformed: layer 0 holds -5 tokens"),
    ]
    assert blob[lens:lens + 8] == le(77) + le(0)
    b = open_path(L, HKV, D, "bf16", BASE_ISAS[0], threads=1)
    for data, msg in bad:
        with pytest.raises(ValueError, match=msg):
            b.import_seq(3, data)
        assert b.num_seqs() == 0 and b.bytes_used() == 0
    with pytest.raises(ValueError, match="^import_seq: sequence 1 is already held by this store$"):
        a.import_seq(1, blob)
    with pytest.raises(ValueError, match="sequence 2 is already held"):
        a.import_seq(2, b"junk")                            # the id is checked first
    assert a.export_seq(1) == blob
    with pytest.raises(KeyError, match="sequence 12345 is not held"):
        a.export_seq(12345)
    with pytest.raises(TypeError):
        b.import_seq(3, "FDKV")                             # str is not a buffer
