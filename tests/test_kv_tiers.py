"""The S-worker's own KV tier, piece by piece: the page pool's bookkeeping (against a plain model
of it), the torch tier's prefill/decode against a float64 attention the test computes from the
K/V it fed, the two tiers behind one backend against each alone, placement's split between tiers
(hand-computed), and the tier's sizing rules."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.engine.kv_tiers import choose_tier, device_tier_bytes
from fastdecode.model.config import ConfigError, ModelConfig
from fastdecode.rpart.base import WorkerInfo
from fastdecode.rpart.device_kv import DeviceKVTier, page_bytes
from fastdecode.rpart.local import LocalBackend
from fastdecode.rpart.page_pool import PagePool, PoolFull
from fastdecode.rpart.tiered import TieredBackend
from fastdecode.rpart.variants import AttentionVariants
from fastdecode.sched.placement import Placement


def tiny_config(layers=2, hq=4, hkv=2, d=16, **kw) -> ModelConfig:
    return ModelConfig("llama", layers, hq * d, hq, hkv, d, 64, 100, 1e-5, 10000.0, 4096, False, **kw)


# ----------------------------------------------------------------------------- the page pool

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["extend", "fork", "free"]), st.integers(0, 5), st.integers(0, 5),
                          st.integers(1, 40)), min_size=1, max_size=60))
def test_page_pool_matches_a_plain_model(ops):
    """Random extends, forks and frees: every sequence's slots are its pages' slots in order, no
    page is held by two sequences unless forked, and freed pages come back exactly once."""
    P = 4
    pool = PagePool(num_pages=64, page_tokens=P)
    tokens: dict[int, list[int]] = {}          # seq -> the flat slot of each of its positions
    for op, a, b, n in ops:
        if op == "extend":
            try:
                slots = pool.extend(a, n)
            except PoolFull:
                assert pool.pages_in_use == 64
                continue
            tokens.setdefault(a, []).extend(slots.tolist())
        elif op == "fork" and a in tokens and b not in tokens:
            whole = (len(tokens[a]) // P) * P
            pool.fork(a, b, whole)
            tokens[b] = tokens[a][:whole]
        elif op == "free":
            pool.free(a)
            tokens.pop(a, None)
        for s, slots in tokens.items():
            assert pool.length[s] == len(slots)
            table = pool.block_table(np.array([s]))[0]
            pos = np.arange(len(slots))
            assert (table[pos // P] * P + pos % P).tolist() == slots      # the table reads the same slots
        # a page is shared only along forks: distinct (seq, position) slots collide only on shared prefixes
        owners: dict[int, set] = {}
        for s, slots in tokens.items():
            for i, slot in enumerate(slots):
                owners.setdefault(slot, set()).add(i)
        assert all(len(pos) == 1 for pos in owners.values())                  # same slot => same position
    used = {p for s in tokens for p in pool.pages[s]}
    assert pool.pages_in_use == len(used)
    assert pool.page_reads == sum(len(pool.pages[s]) for s in tokens)


def test_page_pool_errors_name_the_sequence():
    pool = PagePool(2, 4)
    pool.extend(7, 8)
    with pytest.raises(PoolFull, match="sequence 9"):
        pool.extend(9, 1)
    with pytest.raises(ValueError, match="whole pages"):
        pool.fork(7, 8, 6)
    with pytest.raises(ValueError, match="already holds"):
        pool.fork(7, 7, 4)
    pool.free(7)
    assert pool.pages_in_use == 0 and pool.extend(9, 8).tolist() == list(range(8))


# ----------------------------------------------------------------------------- the torch tier

def attention64(q, keys, values, scale, window=0):
    """float64: q [Hq, D] over keys/values [T, Hkv, D] -> [Hq, D]."""
    hq, hkv = q.shape[0], keys.shape[1]
    if window:
        keys, values = keys[-window:], values[-window:]
    out = np.empty(q.shape)
    for h in range(hq):
        kv = h // (hq // hkv)
        s = keys[:, kv].astype(np.float64) @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = p @ values[:, kv].astype(np.float64) / p.sum()
    return out


def pack(q, k, v):
    """One worker's decode block [q | k | v] of n rows (the wire layout)."""
    return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])


class History:
    """What the test fed each sequence per layer (its own record: the reference reads this)."""

    def __init__(self, layers):
        self.kv = [dict() for _ in range(layers)]         # layer -> seq -> ([T, Hkv, D] K, V)

    def add(self, layer, seq, k, v):
        old = self.kv[layer].get(seq)
        self.kv[layer][seq] = (k, v) if old is None else (np.concatenate([old[0], k]), np.concatenate([old[1], v]))


@pytest.mark.parametrize("windows", [(), (0, 5)], ids=["full", "window5"])
def test_torch_tier_prefill_decode_fork_free_against_float64(windows):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    c = tiny_config(layer_windows=windows)
    var = AttentionVariants.of(c)
    tier = DeviceKVTier(c, "fp32", 64 * page_bytes(c, "fp32", 4), torch.device("cpu"), var, page_tokens=4)
    hist = History(c.num_layers)
    # prefill: seq 1 (6 tokens), seq 2 (9 tokens), rows consecutive per sequence
    rows = np.array([1] * 6 + [2] * 9, dtype=np.int64)
    tier.prefill_begin(rows, [len(rows)])
    for layer in range(c.num_layers):
        k, v = (torch.from_numpy(rng.standard_normal((len(rows), 2, 16)).astype(np.float32)) for _ in range(2))
        tier.prefill_layer(layer, k, v)
        for s in (1, 2):
            m = rows == s
            hist.add(layer, s, k.numpy()[m], v.numpy()[m])
    tier.prefill_end()
    if not windows:                     # seq 3 starts from seq 2's first page (a shared prefix), then appends 2
        tier.prefill_begin(np.array([3, 3]), [2], forks=(np.array([3]), np.array([2]), np.array([4]), [1]))
        for layer in range(c.num_layers):
            k, v = (torch.from_numpy(rng.standard_normal((2, 2, 16)).astype(np.float32)) for _ in range(2))
            tier.prefill_layer(layer, k, v)
            k2, v2 = hist.kv[layer][2]
            hist.kv[layer][3] = (np.concatenate([k2[:4], k.numpy()]), np.concatenate([v2[:4], v.numpy()]))
        tier.prefill_end()
    seqs = [1, 2] + ([] if windows else [3])
    for step in range(7):                                   # crosses page boundaries for every sequence
        if step == 4:
            tier.free([[1]])
            seqs.remove(1)
            for h in hist.kv:
                h.pop(1)
        ids = np.array(seqs)
        tier.decode_begin([(ids, [len(ids)])], c.num_layers)
        for layer in range(c.num_layers):
            q = rng.standard_normal((len(ids), 4, 16)).astype(np.float32)
            k = rng.standard_normal((len(ids), 2, 16)).astype(np.float32)
            v = rng.standard_normal((len(ids), 2, 16)).astype(np.float32)
            tier.decode_submit(layer, 0, pack(*(torch.from_numpy(a) for a in (q, k, v))))
            out = tier.decode_wait(layer, 0).numpy()
            for i, s in enumerate(seqs):
                hist.add(layer, s, k[i:i + 1], v[i:i + 1])
                ref = attention64(q[i], *hist.kv[layer][s], var.scale, var.windows[layer] if windows else 0)
                assert np.abs(out[i] - ref).max() < 2e-5, (step, layer, s)
        stats = tier.decode_end()
        assert stats.kv_bytes == [tier.pool.pages_in_use * tier.page_bytes]
    for s in seqs:
        assert tier.pool.length[s] == hist.kv[0][s][0].shape[0]


def tiny_local(c, capacity=1 << 24):
    return LocalBackend(c, "fp32", threads=1, capacity_bytes=capacity)


def test_tiered_backend_gives_each_side_its_rows():
    """R-workers' rows first, the tier's last: outputs equal each backend driven alone."""
    rng = np.random.default_rng(1)
    c = tiny_config()
    tiered = TieredBackend(tiny_local(c), DeviceKVTier(c, "fp32", 1 << 22, torch.device("cpu"), page_tokens=32))
    alone = [tiny_local(c), DeviceKVTier(c, "fp32", 1 << 22, torch.device("cpu"), page_tokens=32)]
    assert [bool(w.tier) for w in tiered.workers] == [False, True] and tiered.tier_index == 1
    rows = np.array([5, 5, 5, 6, 6], dtype=np.int64)                  # seq 5 on worker 0, seq 6 on the tier
    kv = [(torch.from_numpy(rng.standard_normal((5, 2, 16)).astype(np.float32)),) * 2 for _ in range(2)]
    tiered.prefill_begin(rows, [3, 2], reserve=(np.array([5, 6]), np.array([40, 40]), [1, 1]))
    alone[0].prefill_begin(rows[:3], [3])
    alone[1].prefill_begin(rows[3:], [2])
    for layer, (k, v) in enumerate(kv):
        tiered.prefill_layer(layer, k, v)
        alone[0].prefill_layer(layer, k[:3], v[:3])
        alone[1].prefill_layer(layer, k[3:], v[3:])
    for b in [tiered] + alone:
        b.prefill_end()
    for step in range(3):
        ids = np.array([5, 6])
        tiered.decode_begin([(ids, [1, 1])], 2)
        alone[0].decode_begin([(ids[:1], [1])], 2)
        alone[1].decode_begin([(ids[1:], [1])], 2)
        for layer in range(2):
            q, k, v = (torch.from_numpy(rng.standard_normal((2, h, 16)).astype(np.float32)) for h in (4, 2, 2))
            buf = tiered.decode_buffer(layer, 0, 2 * 8 * 16, torch.device("cpu"), torch.float32)
            buf.copy_(torch.cat([pack(q[:1], k[:1], v[:1]), pack(q[1:], k[1:], v[1:])]))
            tiered.decode_submit(layer, 0, buf)
            got = tiered.decode_wait(layer, 0)
            want = []
            for i, b in enumerate(alone):
                b.decode_submit(layer, 0, pack(q[i:i + 1], k[i:i + 1], v[i:i + 1]))
                want.append(b.decode_wait(layer, 0))
            assert torch.allclose(got, torch.cat(want), atol=1e-6), (step, layer)
        stats = tiered.decode_end()
        assert len(stats.kv_bytes) == 2 and all(b > 0 for b in stats.kv_bytes)
        for b in alone:
            b.decode_end()
    tiered.free([[5], [6]])
    assert tiered.tier.pool.pages_in_use == 0 and tiered.others.store.num_seqs() == 0


# ----------------------------------------------------------------------------- placement across tiers

class Seq:
    def __init__(self, sid, prompt, max_tokens):
        self.seq_id, self.prompt_len, self.max_tokens = sid, prompt, max_tokens
        self.kv_len, self.total_len_bound, self.worker = prompt, prompt + max_tokens, None


def workers(caps, tier_last=True):
    ws = [WorkerInfo(rank=i + 1, host="h", threads=1, isa="x", capacity_bytes=c, page_tokens=1)
          for i, c in enumerate(caps)]
    if tier_last:
        ws[-1].tier = "device"
    return ws


def test_placement_sends_each_sequence_where_its_step_ends_earliest():
    """One R-worker at 100 tokens/s, the tier at 1,000 tokens/s behind 1 s of S-part per step.
    Sequences of 100 projected tokens each (prompt 50, max_tokens 100). By hand: the R-worker's
    step after k sequences: k * 100 / 100 = k s; the tier's: 1 + m * 100 / 1000 = 1 + 0.1 m s.
    Greedy: seq 1 -> R (1 s vs 1.1 s), seq 2: R 2 s vs tier 1.1 s -> tier; then the tier until
    1 + 0.1 m > 2, i.e. m = 10 sequences on the tier (2.0 s, tie goes to R) ..."""
    p = Placement(workers([10**6, 10**6]), 1, policy="full")
    p.set_speeds([100.0, 1000.0])
    p.base_s[1] = 1.0
    chosen = [p.place(Seq(i, 50, 100)) for i in range(30)]
    k = m = 0
    for w in chosen:                       # replay by hand: each choice was the earlier finish
        r_next, t_next = (k + 1) * 1.0, 1.0 + (m + 1) * 0.1
        assert w == (0 if r_next <= t_next else 1), (k, m)
        k, m = (k + 1, m) if w == 0 else (k, m + 1)
    assert chosen[:2] == [0, 1]
    assert chosen.count(1) == m and m > 20         # the tier is 10x faster: it holds most
    assert abs((1 + 0.1 * m) - k) <= 1.0           # and both end their steps within one sequence's time


def test_overflow_only_tier_takes_what_the_r_workers_cannot_hold():
    p = Placement(workers([300, 10**6]), 1, policy="full")
    p.set_speeds([1.0, 1e6])                 # the tier is far faster, but unmeasured S-part: overflow only
    p.overflow_only[1] = True
    placed = [p.place(Seq(i, 50, 100)) for i in range(4)]
    assert placed == [0, 0, 1, 1]            # two fit the R-worker (150 each of 300), the rest overflow
    p.overflow_only[1] = False
    assert p.place(Seq(9, 50, 100)) == 1


def test_tier_that_keeps_window_pages_is_charged_in_full():
    """The device tier keeps a windowed layer's pages: a 1,000-token sequence charges it 1,000
    tokens; an R-worker (window 100 on one of two layers, pages of 1) charges (1000 + 101) / 2."""
    ws = workers([10**6, 10**6])
    ws[1].frees_windows = False
    p = Placement(ws, 1, policy="full", windows=(0, 100))
    s0, s1 = Seq(0, 500, 500), Seq(1, 500, 500)
    assert p.place(s0, worker=0) == 0 and p.place(s1, worker=1) == 1
    assert p.reserved == [math.ceil((1000 + 101) / 2), 1000]


# ----------------------------------------------------------------------------- sizing the tier

def test_tier_choice_rules(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("FASTDECODE_DEVICE_TIER", raising=False)
    assert choose_tier(False, None, cpu, "fp32", 3, 3).why_off == "--no-device-kv"
    assert choose_tier(True, None, cpu, "fp32", 1, 1).kind == ""                      # local mode: the store is all
    # a CPU S-worker beside R-workers: off by default (its attention would take the S-part's cores),
    # on where asked for by --device-kv or by a size
    auto = choose_tier(None, None, cpu, "fp32", 3, 3)
    assert auto.kind == "" and "--device-kv turns it on" in auto.why_off
    assert choose_tier(True, None, cpu, "fp32", 3, 3).kind == "local"
    assert choose_tier(None, 1 << 30, cpu, "fp32", 3, 3).kind == "local"
    beside = choose_tier(True, 1 << 30, cpu, "fp32", 3, 3)
    assert (beside.kind, beside.capacity_bytes) == ("local", 1 << 30)
    with pytest.raises(ConfigError, match="more than this machine's memory"):
        choose_tier(True, 1 << 60, cpu, "fp32", 3, 3)
    monkeypatch.setenv("FASTDECODE_DEVICE_TIER", "torch")
    assert choose_tier(True, 5 << 20, cpu, "bf16", 1, 1).kind == "device"
    assert choose_tier(True, None, cpu, "int8", 1, 1).why_off.startswith("int8 KV")    # int8 has no device tier
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        device_tier_bytes(None, 1.5, cpu, 0)
