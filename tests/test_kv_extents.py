"""Extents: a sequence that outgrows its pages unreserved takes several pages per kv head at once,
so decode growth lands in runs instead of one page per 32 steps wherever the free list has one.
The outputs must not change, the slack must never cost a caller the capacity it counted, and the
layout must actually be runs."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from kvstore_cases import ISAS, Mirror, check, open_store, rand  # noqa: E402

from rworker import KVCapacityError, KVStore  # noqa: E402

L, HKV, D = 2, 2, 64


def grow_round_robin(stores, ids, steps, rng, mirror=None, q_heads=2 * HKV):
    """One token per sequence per step at every layer (a decode step); outputs of all stores."""
    outs = []
    for _ in range(steps):
        for layer in range(L):
            q, k, v = (rand(rng, (len(ids), q_heads, D)), rand(rng, (len(ids), HKV, D)),
                       rand(rng, (len(ids), HKV, D)))
            if mirror is not None:
                mirror.add(layer, ids, k, v)
            outs.append([st.append_attend(layer, ids, q, k, v) for st in stores])
    return outs, q


@pytest.mark.parametrize("isa", ISAS)
def test_extents_give_bitwise_the_outputs_of_single_pages(isa):
    """Prompts, decode growth past several extents, a free and a new sequence in its pages: the
    same bits with extents of 4 pages and with one page at a time, and both right."""
    rng = np.random.default_rng(11)
    one = open_store(L, HKV, D, "bf16", threads=2, isa=isa)
    ext = open_store(L, HKV, D, "bf16", threads=2, isa=isa)
    one.extent_pages, ext.extent_pages = 1, 4
    mirror = Mirror()
    prompts = [1, 31, 33, 64, 90]
    for s, n in enumerate(prompts):
        for layer in range(L):
            k, v = rand(rng, (n, HKV, D)), rand(rng, (n, HKV, D))
            for st in (one, ext):
                st.append(layer, [s] * n, k, v)
            mirror.add(layer, [s] * n, k, v)
    ids = list(range(len(prompts)))
    outs, q = grow_round_robin([one, ext], ids, 150, rng, mirror)
    for a, b in outs:
        assert np.array_equal(a, b)
    check(ext, mirror, L - 1, ids, q, outs[-1][1], "bf16")
    for st in (one, ext):
        assert st.free(2)
    ids = [0, 1, 3, 4, 5]                                    # 5: new, takes freed pages
    outs, _ = grow_round_robin([one, ext], ids, 40, rng)
    for a, b in outs:
        assert np.array_equal(a, b)
    assert ext.bytes_committed() == one.bytes_committed() == one.bytes_used()
    assert ext.bytes_used() > ext.bytes_committed()          # the extents' slack


def test_decode_growth_lands_in_runs_of_an_extent():
    rng = np.random.default_rng(3)
    stores = [KVStore(L, HKV, D, "bf16", threads=1) for _ in range(3)]
    for st, e in zip(stores, (1, 4, 8)):
        st.extent_pages = e
    P = stores[0].page_tokens
    ids = list(range(6))
    grow_round_robin(stores, ids, 10 * P, rng)               # 10 pages per (seq, layer, head)
    for s in ids:
        for layer in range(L):
            runs = [st.page_runs(s, layer) for st in stores]
            assert runs[0] == HKV * 10                       # every page apart from the one before
            assert runs[1] <= HKV * 3 and runs[2] <= HKV * 2     # ceil(10 / E) runs per head
    assert stores[2].bytes_used() > stores[1].bytes_used() > stores[0].bytes_used() == stores[0].bytes_committed()


def test_slack_is_given_back_before_any_counted_page_is_refused():
    """A store exactly as big as the pages the tokens need: every append that fits the counted
    pages must succeed (extents are trimmed to make room), usage never passes the capacity, and
    one page more is refused with nothing stored."""
    P = KVStore(1, HKV, D, "bf16", threads=1).page_tokens
    page = 2 * P * D * 2                                     # one head's K and V run
    seqs, pages_each = 8, 6
    cap = seqs * pages_each * L * HKV * page
    st = KVStore(L, HKV, D, "bf16", threads=1, capacity_bytes=cap)
    st.extent_pages = 4
    rng = np.random.default_rng(2)
    ids = list(range(seqs))
    peak_slack = 0
    for step in range(pages_each * P):
        for layer in range(L):
            k, v = rand(rng, (seqs, HKV, D)), rand(rng, (seqs, HKV, D))
            st.append(layer, ids, k, v)
            assert st.bytes_used() <= cap
            assert st.bytes_committed() == sum(-(-st.num_tokens(s, layer2) // P) for s in ids
                                               for layer2 in range(L)) * HKV * page
            peak_slack = max(peak_slack, st.bytes_used() - st.bytes_committed())
    assert peak_slack > 0                                    # extents were taken while there was room
    assert st.bytes_committed() == cap == st.bytes_used()    # full to the last page, no slack left
    with pytest.raises(KVCapacityError):
        st.append(0, [0], rand(rng, (1, HKV, D)), rand(rng, (1, HKV, D)))
    assert st.num_tokens(0, 0) == pages_each * P


def test_reserve_trims_slack_and_counts_as_committed():
    P = KVStore(1, HKV, D, "bf16", threads=1).page_tokens
    page = 2 * P * D * 2
    st = KVStore(L, HKV, D, "bf16", threads=1, capacity_bytes=40 * page)
    st.extent_pages = 8                                      # first append: 1 page needed, 8 taken if room
    z = np.zeros((1, HKV, D), np.float32)
    for layer in range(L):
        st.append(layer, [1], z, z)
    # room = 7/8 of 40 = 35 head-pages: layer 0 takes 8 x 2 = 16, layer 1 would reach 32: both extents
    assert st.bytes_used() == 32 * page and st.bytes_committed() == 2 * HKV * page
    assert st.reserve([2], [4 * P])                          # 16 head-pages: 32 + 16 > 40, trim first
    assert st.bytes_committed() == st.bytes_used() == (4 + 16) * page
    assert st.num_tokens(1, 0) == 1 and st.num_tokens(2, 0) == 0


def test_extent_pages_setting(monkeypatch):
    st = KVStore(1, 1, 64, threads=1)
    assert st.extent_pages == 8
    with pytest.raises(ValueError):
        st.extent_pages = 0
    monkeypatch.setenv("FASTDECODE_EXTENT_PAGES", "1")
    assert KVStore(1, 1, 64, threads=1).extent_pages == 1


@pytest.mark.parametrize("seed", range(4))
def test_committed_counter_equals_a_walk_after_every_call(seed):
    """bytes_committed is a counter moved by each call's own difference; after any mix of
    reserves, prompt and decode appends of either layer, frees, refusals past the capacity (which
    trim every sequence's slack) and extent changes it must equal the count by walking every
    (sequence, layer)."""
    rng = np.random.default_rng(seed)
    P = KVStore(1, HKV, D, "bf16", threads=1).page_tokens
    page = 2 * P * D * 2
    st = KVStore(L, HKV, D, "bf16", threads=1, capacity_bytes=int(rng.integers(60, 200)) * page)
    live: set[int] = set()
    refused = trimmed = 0
    for call in range(400):
        op = rng.choice(["append", "append", "append", "reserve", "free", "extent"])
        if op == "free" and live:
            sid = int(rng.choice(sorted(live)))
            assert st.free(sid)
            live.discard(sid)
        elif op == "reserve":
            ids = rng.choice(12, size=int(rng.integers(1, 4)), replace=False)
            if st.reserve(ids, rng.integers(0, 5 * P, size=len(ids))):
                live.update(int(i) for i in ids)
            else:
                refused += 1
        elif op == "extent":
            st.extent_pages = int(rng.integers(1, 10))
        else:
            ids = np.repeat(rng.choice(12, size=int(rng.integers(1, 5)), replace=False),
                            rng.integers(1, 2 * P, size=1))          # a prompt block or one token each
            rows = len(ids)
            slack_before = st.bytes_used() - st.bytes_committed()
            try:
                st.append(int(rng.integers(0, L)), ids, rand(rng, (rows, HKV, D)), rand(rng, (rows, HKV, D)))
                live.update(int(i) for i in ids)
            except KVCapacityError:
                refused += 1
            trimmed += slack_before > 0 and st.bytes_used() - st.bytes_committed() < slack_before
        assert st.bytes_committed() == st._st.bytes_committed_walk(), f"call {call} ({op})"
        assert st.bytes_committed() <= st.bytes_used()
    assert refused > 0 and trimmed > 0                           # the trim paths were exercised
