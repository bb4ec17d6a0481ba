"""Shared prefixes in the KV store (KVStore.fork, issue 32): a sequence forked from another shares
its full pages by reference (refcounted), a partial last page copied; decode attention reads the
shared pages once per group of rows holding them (attention.h, "Shared prefixes").

Here: outputs with sharing against an unshared store holding the same tokens per sequence (the
tolerance and why: tests/prefix_cases.py) and against the float64 references, on every path,
KV dtype, query dtype and GQA/MHA shape; groups of several member blocks, several groups and
unshared rows in one call, nested forks; a member alone in its call gives the unshared bits; pages
never leak and a freed member never frees what another reads (a hypothesis property test against a
model of who holds which page); errors; appends after a fork never write a shared page.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from kvstore_cases import open_store  # noqa: E402
from prefix_cases import EMU, FAST, FAST_PAIRS, PAIRS, PT, ROWS_PER_ITEM, PageModel, Twin, ok_for  # noqa: E402

from rworker import KVCapacityError  # noqa: E402

DTYPES = ["fp32", "bf16", "int8"]
SHAPES = [(2, 4, 64), (1, 8, 128), (2, 3, 80), (2, 1, 128)]      # (Hkv, g, D): GQA 4, 8, 3 and MHA


def shape_id(shape):
    _, g, D = shape
    return f"{'mha' if g == 1 else f'gqa{g}'}-D{D}"


def three_families(tw, small=False):
    """One store, three families and two unshared sequences. A: fork at 1024 (a chunk edge), a
    1100-token donor, members with no own tokens and one whose own part spans two chunks; B: fork
    at 650 (mid-page: a copied partial page), a member spanning three chunks of its own; C: fork
    at 96 with a donor of exactly 96 (it and one member hold no own token). `small`
    (SIMDe): one family forked at 544 (shared part over a chunk edge). Returns every id."""
    if small:
        tw.family(0, [1, 2, 3], 560, 544, [0, 5, 520])
        tw.grow(30, 40)
        return [0, 1, 2, 3, 30]
    tw.family(0, [1, 2, 3, 4], 1100, 1024, [0, 0, 7, 600])
    tw.family(10, [11, 12, 13], 700, 650, [0, 31, 1100])
    tw.family(20, [21, 22, 23], 96, 96, [0, 33, 1])
    tw.grow(30, 1)
    tw.grow(31, 513)
    return [0, 1, 2, 3, 4, 10, 11, 12, 13, 20, 21, 22, 23, 30, 31]


def _cases():
    """(path, kv dtype, shape, bf16 queries): the ISA builds on every shape and dtype, bf16 queries
    on two shapes; the second V layouts and V pairs on two shapes; AMX where it runs (bf16 K and
    queries, or int8 K, on two GQA shapes)."""
    out = []
    for path in FAST + [p for p in PAIRS if p in FAST_PAIRS]:
        for kv in DTYPES:
            if not ok_for(path, kv):
                continue
            if "+" not in path:
                out += [(path, kv, shape, False) for shape in SHAPES]
                out += [(path, kv, shape, True) for shape in SHAPES[:2] if kv != "fp32" or path == "avx512"]
            elif "+amx" in path:
                out += [(path, kv, shape, True) for shape in SHAPES[:2]]
            else:
                out += [(path, kv, SHAPES[0], kv == "bf16"), (path, kv, SHAPES[3], False)]
    return out


@pytest.mark.parametrize("path,kv_dtype,shape,q_bf16", _cases(),
                         ids=[f"{p}-{k}-{shape_id(s)}-q{'bf16' if b else 'fp32'}" for p, k, s, b in _cases()])
def test_shared_store_matches_unshared(path, kv_dtype, shape, q_bf16):
    """Every sequence of the three families and the unshared ones in one call (shuffled), at both
    layers: within the tolerance of the unshared store and of the float64 references."""
    Hkv, g, D = shape
    tw = Twin(path, 2, Hkv, D, kv_dtype, seed=D * 10 + g)
    ids = three_families(tw)
    tw.rng.shuffle(ids)
    for layer in range(2):      # the float64 references at layer 1 (int8: on a few rows, slow)
        q = tw.query(len(ids), g, q_bf16, scale=2.0)
        ref = layer == 1 and (True if kv_dtype != "int8" else [2, 4, 12, 13, 22, 30])
        tw.compare(layer, ids, q, f"{path} {kv_dtype} {shape_id(shape)} layer {layer}", reference=ref)
    stats = tw.shared.sharing_stats()
    # A: 32 pages x 4 members, B: 20 x 3, C: 3 x 3 (+ the donor each), per (layer, kv head)
    assert stats["shared_pages"] == (32 + 20 + 3) * 2 * Hkv
    assert stats["shared_page_refs"] == (32 * 5 + 20 * 4 + 3 * 4) * 2 * Hkv
    assert stats["bytes_saved"] == (32 * 4 + 20 * 3 + 3 * 3) * 2 * Hkv * tw.shared.page_bytes
    assert tw.plain.bytes_committed() - tw.shared.bytes_committed() == stats["bytes_saved"]
    assert tw.shared.bytes_committed() == tw.shared._st.bytes_committed_walk()


EMU_CASES = [(p, kv) for p in EMU + [p for p in PAIRS if p.startswith("avx512emu")] for kv in DTYPES if ok_for(p, kv)
             and (kv == "bf16" or p == "avx512emu")]


@pytest.mark.parametrize("path,kv_dtype", EMU_CASES, ids=[f"{p}-{k}" for p, k in EMU_CASES])
def test_shared_store_matches_unshared_simde(path, kv_dtype):
    """The SIMDe build of the AVX-512 code (slow): one small family, GQA 4 and bf16 queries."""
    tw = Twin(path, 1, 2, 64, kv_dtype, seed=3)
    ids = three_families(tw, small=True)
    q = tw.query(len(ids), 4, bf16=kv_dtype != "fp32", scale=2.0)
    tw.compare(0, ids[::-1], q, f"{path} {kv_dtype}")


def test_the_tolerance_sees_one_token():
    """Not vacuous: an unshared store missing the first own token of a member, or the last shared
    one, is outside the tolerance for that member (the longest sequence tested, 1750 tokens)."""
    tw = Twin(FAST[0], 1, 2, 128, "fp32", seed=9)
    tw.family(10, [11], 700, 650, [1100])
    q = tw.query(1, 4)
    o = tw.shared.attend(0, [11], q)
    k, v = tw.kv(11, 0)
    for drop in (650, 649):
        off = open_store(1, 2, 128, "fp32", threads=2, isa=FAST[0])
        keep = np.arange(len(k)) != drop
        off.append(0, np.full(keep.sum(), 11), k[keep], v[keep])
        err = np.abs(o[0].astype(np.float64) - off.attend(0, [11], q)[0])
        assert (err > tw.tol(11, 0, q[0])).any(), f"token {drop} dropped: max err {err.max():.3g} within the tolerance"


# ---------------------------------------------------------------------------------------------
# groups: member blocks, several groups, a member alone, nested forks


GROUP_CASES = ([(p, g) for p in FAST if "+" not in p or "+amx" in p for g in (1, 3, 8)]
               + [(p, g) for p in FAST_PAIRS if "+amx" in p for g in (1, 3)] + [(p, 8) for p in EMU[:1]])


@pytest.mark.parametrize("path,g", GROUP_CASES, ids=[f"{p}-g{g}" for p, g in GROUP_CASES])
def test_groups_of_several_member_blocks(path, g):
    """A group of 2 * (64 // g) + 3 members (three blocks, the last of 3 rows), a second group of
    one block + 1 (its shared part two chunks), a third of two, unshared rows, one member's id
    twice: ids interleaved at random. AMX: bf16 K and queries, a block's members stacked in tile
    products of up to 16 rows (MHA members too: g = 1); with V pairs PV on the tiles as well."""
    kv_dtype = "bf16" if "+amx" in path or "+pairs" in path else "fp32"
    tw = Twin(path, 1, 2, 64, kv_dtype, seed=g)
    block = max(1, ROWS_PER_ITEM // g)
    big = tw.family(0, range(1, 2 * block + 4), 300, 288, tw.rng.integers(0, 40, 2 * block + 3))
    mid = tw.family(1000, range(1001, 1002 + block), 700, 600, tw.rng.integers(0, 100, block + 1))
    two = tw.family(2000, [2001], 40, 33, [3])
    tw.grow(3000, 70)
    ids = [0] + big + [1000] + mid + [2000] + two + [3000, big[5], big[5]]
    tw.rng.shuffle(ids)
    q = tw.query(len(ids), g, bf16=kv_dtype == "bf16")
    tw.compare(0, ids, q, f"{path} g={g} {len(ids)} rows", reference=g != 1)


ALONE_CASES = [(p, kv) for p in FAST + FAST_PAIRS for kv in DTYPES if ok_for(p, kv)]


@pytest.mark.parametrize("path,kv_dtype", ALONE_CASES, ids=[f"{p}-{kv}" for p, kv in ALONE_CASES])
def test_a_member_alone_in_its_call_is_bitwise_unshared(path, kv_dtype):
    """A row whose group has no other row in the call runs over all its pages as before: the same
    bits as the unshared store, alone and beside other groups' single members and unshared rows."""
    tw = Twin(path, 1, 2, 128, kv_dtype, seed=4)
    three_families(tw)
    q_bf16 = kv_dtype == "bf16"
    calls = [[2], [4], [0], [12], [13, 4, 31, 22], [20, 11, 30, 3], [1, 23]]
    for ids in calls:
        q = tw.query(len(ids), 4, q_bf16)
        o, p = tw.attend(0, ids, q)
        assert np.array_equal(o, p), f"{path} {kv_dtype} call {ids}: max diff {np.abs(o - p).max():.3g}"


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("path", [p for p in FAST if "+" not in p])
def test_nested_forks(path, kv_dtype):
    """Forks of forks: from a member at a length past its shared pages (into its own), at a
    length inside them, a donor forked again at a longer and a shorter length."""
    tw = Twin(path, 1, 2, 64, kv_dtype, seed=5)
    tw.family(0, [1], 1200, 600, [100])        # 1: 576 shared + own 24 (copied) + 100
    tw.family(1, [2], 0, 680, [50])            # 2: from a member, past its shared pages
    tw.family(2, [3], 0, 64, [0])              # 3: inside them (2 pages)
    tw.family(0, [4, 5], 0, 1100, [0, 700])    # the donor again, longer: its own part spans chunks
    tw.family(1, [6], 0, 700, [700])
    tw.family(0, [7], 0, 31, [2])              # shorter than a page: nothing shared, one copied
    ids = [7, 3, 0, 5, 1, 6, 2, 4]
    label = f"{path} {kv_dtype} nested"
    tw.compare(0, ids, tw.query(len(ids), 4), label)
    for sub in ([1, 2, 6], [0, 4], [3, 0], [2, 3, 1]):
        tw.compare(0, sub, tw.query(len(sub), 4), f"{label} {sub}")
    assert tw.shared.bytes_committed() == tw.shared._st.bytes_committed_walk()


# ---------------------------------------------------------------------------------------------
# refcounts: pages never leak, a freed sequence never frees what another reads

OPS = st.lists(st.tuples(st.sampled_from(["new", "fork", "fork", "grow", "free", "reserve", "attend"]),
                         st.integers(0, 2**16), st.integers(0, 2**16)), min_size=1, max_size=40)


def apply_op(tw, model, op, a, b, new_id):
    """One random operation on both stores and the model; returns the label of what it did."""
    live = sorted(model.seqs)
    full = [s for s in live if model.seqs[s]["len"] > 0]
    if op == "fork" and full:
        src = full[a % len(full)]
        tokens = 1 + b % model.seqs[src]["len"]
        tw.fork(src, new_id, tokens)
        model.fork(src, new_id, tokens)
        return f"fork({src}, {new_id}, {tokens})"
    if op in ("grow", "free", "attend") and live:
        s = live[a % len(live)]
        if op == "grow":
            tw.grow(s, 1 + b % 70)
            model.grow(s, 1 + b % 70)
        elif op == "free":
            tw.free(s)
            model.free(s)
        elif full:
            ids = [full[(a + i * b) % len(full)] for i in range(1 + b % 6)]     # repeats allowed
            tw.compare(a % tw.L, ids, tw.query(len(ids), 2), f"attend {ids}", reference=False)
        return f"{op} {s}"
    if op == "reserve":
        s = live[a % len(live)] if live and a % 4 else new_id
        assert tw.shared.reserve([s], [b % 300]) and tw.plain.reserve([s], [b % 300])
        model.reserve(s, b % 300)
        return f"reserve({s}, {b % 300})"
    tw.grow(new_id, 1 + b % 150)
    model.grow(new_id, 1 + b % 150)
    return f"new {new_id}"


def assert_accounts(st_, model, label):
    stats, committed = model.expected(st_)
    assert st_.bytes_committed() == st_._st.bytes_committed_walk(), f"{label}: counter != walk"
    assert st_.sharing_stats() == stats, f"{label}: {st_.sharing_stats()} != model {stats}"
    assert st_.bytes_committed() == committed, f"{label}: committed {st_.bytes_committed()} != model {committed}"
    assert st_.num_seqs() == len(model.seqs), label
    for s, q in model.seqs.items():
        assert st_.num_tokens(s, 0) == st_.num_tokens(s, 1) == q["len"], f"{label}: seq {s}"


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
@settings(max_examples=300, deadline=None)
@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
def test_pages_never_leak(kv_dtype, ops, seed):
    """Random creations, forks (of forks too, at any length), appends, frees, reservations and
    calls: after every one the accounts are those of a model of who holds which page (shared
    pages counted once), the counter equals the walk, the calls' outputs equal the unshared
    store's; freeing everything leaves no page in use and nothing shared."""
    tw = Twin(FAST[0], 2, 2, 16, kv_dtype, seed, threads=1)
    assert tw.shared.page_tokens == PT
    model = PageModel()
    for n, (op, a, b) in enumerate(ops):
        label = f"op {n}: " + apply_op(tw, model, op, a, b, new_id=1000 + n)
        assert_accounts(tw.shared, model, label)
    full = [s for s in sorted(model.seqs) if model.seqs[s]["len"] > 0]
    for layer in range(2) if full else ():
        tw.compare(layer, full, tw.query(len(full), 2), f"all live at layer {layer}", reference=kv_dtype == "fp32")
    for s in list(model.seqs):
        tw.free(s)
        model.free(s)
        assert_accounts(tw.shared, model, f"free {s}")
    assert tw.shared.bytes_used() == 0 and tw.shared.sharing_stats()["shared_page_refs"] == 0


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("path", [p for p in FAST if "+" not in p])
def test_freed_sequences_never_free_pages_others_read(path, kv_dtype):
    """The donors and some members freed: the survivors' outputs are the same bits for the same
    calls (and a survivor alone the unshared bits), also after new sequences took the freed pages
    and wrote theirs, and after a fork of a survivor whose donor is gone."""
    tw = Twin(path, 1, 2, 64, kv_dtype, seed=6)
    three_families(tw)
    calls = [[3, 4, 31], [11, 12, 2], [13], [21, 22], [23]]     # groups of two, single members
    qs = [tw.query(len(c), 4) for c in calls]
    before = [tw.shared.attend(0, c, q) for c, q in zip(calls, qs)]

    def unchanged(label):
        for c, q, o in zip(calls, qs, before):
            after = tw.compare(0, c, q, f"{label}: call {c}", reference=False)
            assert np.array_equal(after, o), f"{label}: call {c} changed (max {np.abs(after - o).max():.3g})"
            if len(c) == 1:
                assert np.array_equal(after, tw.plain.attend(0, c, q)), f"{label}: {c} alone != unshared"

    for s in (0, 1, 10, 20):
        tw.free(s)
    unchanged("donors freed")
    for s in range(100, 106):                 # new sequences in the freed pages (LIFO: first)
        tw.grow(s, int(tw.rng.integers(1, 1200)))
    unchanged("new sequences in the freed pages")
    tw.fork(12, 200, 660)                     # from a member whose donor is gone, past its shared part
    tw.grow(200, 30)
    tw.compare(0, [200, 12, 11, 13], tw.query(4, 4), "fork of an orphan member")
    unchanged("after a fork of an orphan")
    for s in sorted({key[0] for key in tw.k}):
        tw.free(s)
    assert tw.shared.num_seqs() == 0 and tw.shared.bytes_used() == 0
    assert tw.shared.sharing_stats() == {"shared_pages": 0, "shared_page_refs": 0, "bytes_saved": 0}


# ---------------------------------------------------------------------------------------------
# errors


def test_fork_errors_name_the_sequence_and_change_nothing():
    st_ = open_store(2, 2, 64, "fp32", threads=1, isa=FAST[0])
    z = np.zeros((50, 2, 64), np.float32)
    for layer in range(2):
        st_.append(layer, [7001] * 40, z[:40], z[:40])
    st_.append(0, [8002] * 50, z, z)
    st_.append(1, [8002] * 20, z[:20], z[:20])             # shorter at layer 1
    state = (st_.num_seqs(), st_.bytes_used(), st_.bytes_committed(), st_.sharing_stats())
    cases = [(9009, 5005, 10, ("9009",), "unknown source"), (7001, 8002, 10, ("8002",), "existing destination"),
             (7001, 5005, 41, ("7001",), "longer than the source"), (8002, 5005, 30, ("8002",), "longer at layer 1"),
             (7001, 5005, 0, ("7001", "5005"), "no tokens"), (7001, 5005, -3, ("7001", "5005"), "negative tokens")]
    for src, dst, tokens, names, what in cases:
        with pytest.raises(ValueError) as e:
            st_.fork(src, dst, tokens)
        assert any(name in str(e.value) for name in names), \
            f"fork({src}, {dst}, {tokens}) ({what}): the message {str(e.value)!r} does not name sequence {names[0]}"
        assert (st_.num_seqs(), st_.bytes_used(), st_.bytes_committed(), st_.sharing_stats()) == state, what
        assert st_.num_tokens(5005, 0) == 0, what
    st_.fork(8002, 5005, 20)                                   # what all layers hold: fine
    assert st_.num_tokens(5005, 0) == st_.num_tokens(5005, 1) == 20


def test_fork_into_a_full_store():
    """A fork at a page edge takes no page: it succeeds in a full store. One with a partial page
    needs a page per (layer, kv head): KVCapacityError naming both sequences, nothing stored; it
    fits once a freed holder gave back its own pages (the shared ones stay for the fork)."""
    Hkv, D = 2, 64
    page = open_store(1, Hkv, D, "fp32", threads=1, isa=FAST[0]).page_bytes
    tw = Twin(FAST[0], 1, Hkv, D, "fp32", seed=10, threads=1, capacity_bytes=3 * Hkv * page)
    st_ = tw.shared
    tw.grow(1, 70)                                             # 3 pages per head: full
    assert st_.bytes_used() == 3 * Hkv * page
    tw.fork(1, 2, 64)
    assert st_.bytes_used() == 3 * Hkv * page and st_.sharing_stats()["shared_pages"] == 2 * Hkv
    with pytest.raises(KVCapacityError, match="fork of sequence 1 into 3"):
        tw.fork(1, 3, 65)
    assert st_.num_seqs() == 2 and st_.num_tokens(3, 0) == 0 and st_.bytes_used() == 3 * Hkv * page
    tw.free(1)                                                 # its third page goes, pages 0-1 stay
    assert st_.bytes_used() == 2 * Hkv * page and st_.sharing_stats()["shared_pages"] == 0
    tw.fork(2, 3, 40)
    assert st_.bytes_committed() == st_._st.bytes_committed_walk() == 3 * Hkv * page
    tw.compare(0, [2, 3], tw.query(2, 2), "after the freed holder")


# ---------------------------------------------------------------------------------------------
# appends after a fork


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("path", [p for p in FAST if "+" not in p] + EMU[:1])
def test_appends_after_a_fork_never_write_shared_pages(path, kv_dtype):
    """A donor of 100 tokens (a partial last page) forked at 100, 64 and 96: the donor's appends
    leave each member's output the same bits, the members' appends (from a copied partial page, a
    page edge, mid-page) leave the donor's; then decode steps through append_attend, all in one
    call, against the unshared store."""
    tw = Twin(path, 2, 2, 64, kv_dtype, seed=8)
    tw.grow(0, 100)
    for m, at in ((1, 100), (2, 64), (3, 96)):
        tw.fork(0, m, at)
    qs = {s: tw.query(1, 2) for s in range(4)}

    def alone(s):
        o, p = tw.attend(1, [s], qs[s])
        assert np.array_equal(o, p), f"{path} {kv_dtype}: seq {s} alone != unshared"
        return o

    before = {s: alone(s) for s in (1, 2, 3)}
    tw.grow(0, 40)                                 # the donor: its own partial page, then a new one
    for s in (1, 2, 3):
        assert np.array_equal(alone(s), before[s]), f"{path} {kv_dtype}: member {s} moved with the donor's appends"
    donor = alone(0)
    for m, n in ((1, 5), (2, 45), (3, 1)):
        tw.grow(m, n)
    assert np.array_equal(alone(0), donor), f"{path} {kv_dtype}: the donor moved with the members' appends"
    for step in range(3 if path in EMU else 40):
        tw.step([2, 0, 3, 1], 2, f"{path} {kv_dtype} step {step}")
    tw.compare(1, [0, 1, 2, 3], tw.query(4, 2), f"{path} {kv_dtype} after the steps")
