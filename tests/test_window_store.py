"""Sliding windows in the KV store's pages (csrc/avx512/paging.h, "Sliding windows"): a layer with
window W keeps only the pages that hold some of a sequence's last W tokens. Pages wholly before
them are given back as appends pass them and never taken by an append that would leave them dead
at once (a prefill of 8k tokens into W = 512 holds 16-17 pages per head, not 256); a reservation
takes at most what the window keeps live. The accounting stays exact (the O(1) bytes_committed
counter equals the walk after every call of random sequences, a hypothesis property), page runs
count live pages, a windowed store admits more sequences at the same capacity, fork is refused,
and the memory figure: a Gemma-style store (5 of 6 layers W = 512) holding 8k-token sequences
commits <= 30% of what the full-attention store does.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from kernel_ref import attention_ref, fp32_tolerance  # noqa: E402

from rworker import KVCapacityError, KVStore  # noqa: E402

PT = 32
HKV, D, G = 2, 64, 2


def rand(rng, n, hkv=HKV, d=D):
    return rng.standard_normal((n, hkv, d)).astype(np.float32), rng.standard_normal((n, hkv, d)).astype(np.float32)


def live_pages(T, W):
    """Pages per head a (sequence, layer) of T tokens holds live: from the window's first page."""
    lo = max(0, T - W) if W else 0
    return -(-T // PT) - lo // PT


def check_attend(store, layer, sid, k, v, rng):
    """The store's output for sid against the reference over its window's tokens (k, v: all appended)."""
    W = store.windows[layer]
    lo = max(0, len(k) - W) if W else 0
    q = rng.standard_normal((1, HKV * G, D)).astype(np.float32)
    o = store.attend(layer, [sid], q)[0]
    ref = attention_ref(q[0], k[lo:].astype(np.float64), v[lo:].astype(np.float64), store.scale)
    assert (np.abs(o - ref) <= fp32_tolerance(q[0], k[lo:], v[lo:], store.scale)[:, None]).all(), \
        f"layer {layer} seq {sid} len {len(k)} W {W}"


def exact(store):
    assert store.bytes_committed() == store._st.bytes_committed_walk()
    assert store.bytes_committed() <= store.bytes_used()


def test_a_long_prefill_never_holds_the_tokens_before_the_window():
    """8,192 tokens into W = 512 in one append fit a capacity of 24 pages per head: the 240 pages
    per head before the window are never taken, their rows never copied. Decode then gives back
    a page per head each 32 steps and the committed bytes stay at the window's 16-17 pages."""
    rng = np.random.default_rng(1)
    page = KVStore(1, HKV, D, "fp32", threads=2).page_bytes
    cap = 24 * HKV * page
    full = KVStore(1, HKV, D, "fp32", threads=2, capacity_bytes=cap)
    k, v = rand(rng, 8192)
    with pytest.raises(KVCapacityError):
        full.append(0, [0] * 8192, k, v)
    st_ = KVStore(1, HKV, D, "fp32", threads=2, capacity_bytes=cap, windows=(512,))
    st_.append(0, [0] * 8192, k, v)
    assert st_.bytes_committed() == 16 * HKV * page and st_.bytes_used() <= cap
    assert st_.page_runs(0, 0) == HKV                          # each head's live pages one run
    exact(st_)
    check_attend(st_, 0, 0, k, v, rng)
    for step in range(100):                                   # decode: pages die as the window passes
        k1, v1 = rand(rng, 1)
        q = rng.standard_normal((1, HKV * G, D)).astype(np.float32)
        st_.append_attend(0, [0], q, k1, v1)
        k, v = np.concatenate([k, k1]), np.concatenate([v, v1])
        assert st_.bytes_committed() == live_pages(len(k), 512) * HKV * page, f"step {step}"
        exact(st_)
    check_attend(st_, 0, 0, k, v, rng)
    assert st_.free(0) and st_.bytes_used() == 0 and st_.bytes_committed() == 0


def test_chunked_prefill_gives_pages_back_as_it_goes():
    """A prompt in chunks of 1000 tokens (the S-worker's chunked prefill) at two layers, one full:
    after each chunk the windowed layer holds its live pages only; every chunk's rows are right."""
    rng = np.random.default_rng(2)
    st_ = KVStore(2, HKV, D, "fp32", threads=2, windows=(0, 300))
    page = st_.page_bytes
    k, v = rand(rng, 7000)
    for t in range(0, 7000, 1000):
        for layer in (0, 1):
            st_.append(layer, [5] * 1000, k[t:t + 1000], v[t:t + 1000])
        T = t + 1000
        assert st_.bytes_committed() == (live_pages(T, 0) + live_pages(T, 300)) * HKV * page
        exact(st_)
        check_attend(st_, 1, 5, k[:T], v[:T], rng)
    check_attend(st_, 0, 5, k, v, rng)


def test_reserve_takes_only_what_the_window_keeps_live():
    rng = np.random.default_rng(3)
    st_ = KVStore(2, HKV, D, "fp32", threads=1, windows=(100, 0))
    page = st_.page_bytes
    assert st_.reserve([1], [10000])
    window_pages = (100 + 2 * PT - 2) // PT                   # 100 tokens straddle at most 5 pages
    assert st_.bytes_committed() == (window_pages + 313) * HKV * page
    exact(st_)
    k, v = rand(rng, 10000)
    for layer in (0, 1):
        st_.append(layer, [1] * 10000, k, v)
    assert st_.bytes_committed() == (live_pages(10000, 100) + 313) * HKV * page
    exact(st_)
    check_attend(st_, 0, 1, k, v, rng)
    assert st_.reserve([1], [20000])                          # more tokens, the window's pages at most
    assert st_.bytes_committed() <= (window_pages + 625) * HKV * page
    exact(st_)
    assert st_.free(1) and st_.bytes_used() == 0


def test_a_windowed_store_admits_more_sequences():
    """Same capacity, 2,048-token prompts: W = 256 at every layer admits 5x the sequences or more."""
    rng = np.random.default_rng(4)
    page = KVStore(1, HKV, D, "bf16", threads=1).page_bytes
    cap = 2 * 4 * 64 * HKV * page                            # 2 layers x 4 prompts of 64 pages per head
    admitted = []
    for windows in (None, (256, 256)):
        store = KVStore(2, HKV, D, "bf16", threads=2, capacity_bytes=cap, windows=windows)
        k, v = rand(rng, 2048)
        n = 0
        try:
            while n < 100:
                for layer in (0, 1):
                    store.append(layer, [n] * 2048, k, v)
                n += 1
        except KVCapacityError:
            pass
        exact(store)
        admitted.append(n)
    assert admitted[0] == 4 and admitted[1] >= 5 * admitted[0], admitted


def test_fork_is_refused_with_windows():
    store = KVStore(2, 1, D, "bf16", threads=1, windows=(0, 64))
    k, v = rand(np.random.default_rng(5), 100, 1)
    store.append(0, [0] * 100, k, v)
    with pytest.raises(ValueError, match="prefix sharing is not offered with sliding windows"):
        store.fork(0, 1, 64)
    with pytest.raises(ValueError, match="layer 1 has window 64"):
        store._st.fork(0, 1, 64)                              # the C++ store refuses too
    assert store.num_seqs() == 1


def test_memory_figure_gemma_style():
    """Gemma-style (6 layers, 5 with W = 512, 1 full; 1 kv head x 64 dims keeps it fast: the ratio
    is per page): 8,192-token sequences, prompt then 64 decode steps, bytes_committed of the two
    stores per sequence. Measured: (5 x 16 + 258) / (6 x 258) = 21.8% (printed; the window's 512
    tokens end on a page edge at 8,256, so it holds 16 pages per head, 17 between edges)."""
    rng = np.random.default_rng(6)
    windows = (512, 512, 512, 512, 512, 0)
    stores = [KVStore(6, 1, D, "bf16", threads=2, windows=w) for w in (None, windows)]
    nseq = 2
    for sid in range(nseq):
        k, v = rand(rng, 8192, 1)
        for store in stores:
            for layer in range(6):
                store.append(layer, [sid] * 8192, k, v)
    for _ in range(64):
        k, v = rand(rng, nseq, 1)
        q = rng.standard_normal((nseq, 4, D)).astype(np.float32)
        for store in stores:
            for layer in range(6):
                store.append_attend(layer, list(range(nseq)), q, k, v)
    per_seq = [s.bytes_committed() / nseq for s in stores]
    ratio = per_seq[1] / per_seq[0]
    print(f"\nGemma-style store, 8,256-token sequences: {per_seq[1] / 2**20:.2f} MiB vs {per_seq[0] / 2**20:.2f} MiB "
          f"committed per sequence, ratio {ratio:.1%}")
    for s in stores:
        exact(s)
    assert ratio <= 0.30
    assert ratio == (5 * live_pages(8256, 512) + live_pages(8256, 0)) / (6 * live_pages(8256, 0))


# ---------------------------------------------------------------------------------------------
# the property: counter == walk after any calls, outputs right at the end

OPS = st.lists(st.tuples(st.sampled_from(["prompt", "decode", "decode", "reserve", "free", "extent"]),
                         st.integers(0, 2**16), st.integers(0, 2**16)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
def test_counter_equals_walk_after_random_calls(ops, seed):
    """Appends (prompts of up to 700 tokens, decode steps of several sequences), reservations, frees
    and extent changes on a store with windows of 1, 45 and 100 tokens and a full layer, and a
    capacity that refuses some (trimming every sequence's slack): after every call the counter
    equals the walk and no more than what is in use; at the end every sequence attends right."""
    rng = np.random.default_rng(seed)
    windows = (1, 45, 0, 100)
    page = KVStore(1, 1, 16, "fp32", threads=1).page_bytes
    store = KVStore(4, 1, 16, "fp32", threads=1, windows=windows, capacity_bytes=int(rng.integers(40, 160)) * page)
    data: dict[tuple[int, int], list[np.ndarray]] = {}
    for op, a, b in ops:
        sids = sorted({a % 6, b % 6})
        layer = b % 4
        try:
            if op == "prompt":
                n = 1 + a % 700
                k, v = rand(rng, n, 1, 16)
                store.append(layer, [sids[0]] * n, k, v)
                data.setdefault((sids[0], layer), []).append(np.stack([k, v]))
            elif op == "decode":
                k, v = rand(rng, len(sids), 1, 16)
                store.append(layer, sids, k, v)
                for i, s in enumerate(sids):
                    data.setdefault((s, layer), []).append(np.stack([k[i:i + 1], v[i:i + 1]]))
            elif op == "reserve":
                store.reserve(sids, [a % 2000] * len(sids))
            elif op == "free":
                store.free(sids[0])
                data = {key: x for key, x in data.items() if key[0] != sids[0]}
            else:
                store.extent_pages = 1 + a % 9
        except KVCapacityError:
            pass
        assert store.bytes_committed() == store._st.bytes_committed_walk(), f"{op} {sids} layer {layer}"
        assert store.bytes_committed() <= store.bytes_used()
    G_ = 2
    for (sid, layer), parts in data.items():
        kv = np.concatenate(parts, axis=1)
        T, W = kv.shape[1], windows[layer]
        assert store.num_tokens(sid, layer) == T
        lo = max(0, T - W) if W else 0
        q = rng.standard_normal((1, G_, 16)).astype(np.float32)
        o = store.attend(layer, [sid], q)[0]
        k, v = kv[0, lo:], kv[1, lo:]
        ref = attention_ref(q[0], k.astype(np.float64), v.astype(np.float64), store.scale)
        assert (np.abs(o - ref) <= fp32_tolerance(q[0], k, v, store.scale)[:, None]).all()
    for sid in {s for s, _ in data}:
        store.free(sid)
    for sid in range(6):
        store.free(sid)
    assert store.bytes_used() == 0 and store.bytes_committed() == 0
