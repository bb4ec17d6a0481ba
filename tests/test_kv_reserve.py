"""Page reservation: a sequence's pages for its whole reservation are taken at prefill (one run per
(layer, kv head) instead of a page wherever the free list has one every 32 decode steps). The
outputs must not change, the accounting must, and past capacity nothing is taken."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import batch_line, run_fastdecode  # noqa: E402
from kvstore_cases import ISAS, Mirror, check, open_store, rand  # noqa: E402

from rworker import KVStore  # noqa: E402


@pytest.mark.parametrize("isa", ISAS)
def test_reserved_sequences_give_bitwise_the_outputs_of_unreserved_ones(isa):
    """Decode-like growth (prompts, then one token per step for every sequence) in a store that
    reserved each sequence's whole length and in one that did not: same bits, both right."""
    rng = np.random.default_rng(5)
    L, Hkv, D = 2, 2, 64
    plain = open_store(L, Hkv, D, "bf16", threads=2, isa=isa)
    held = open_store(L, Hkv, D, "bf16", threads=2, isa=isa)
    P = plain.page_tokens
    prompts, gen = [5, 31, 32, 33, 70], 40
    ids = list(range(len(prompts)))
    assert held.reserve(ids, [n + gen for n in prompts])
    pages = sum(-(-(n + gen) // P) for n in prompts)
    assert held.bytes_used() == pages * L * Hkv * 2 * P * D * 2 and held.num_tokens(0) == 0
    mirror = Mirror()
    for s, n in enumerate(prompts):
        for layer in range(L):
            k, v = rand(rng, (n, Hkv, D)), rand(rng, (n, Hkv, D))
            plain.append(layer, [s] * n, k, v)
            held.append(layer, [s] * n, k, v)
            mirror.add(layer, [s] * n, k, v)
    for step in range(gen + 10):          # 10 steps past the reservation: those pages come on demand
        for layer in range(L):
            q, k, v = rand(rng, (len(ids), 2 * Hkv, D)), rand(rng, (len(ids), Hkv, D)), rand(rng, (len(ids), Hkv, D))
            mirror.add(layer, ids, k, v)
            a = plain.append_attend(layer, ids, q, k, v)
            b = held.append_attend(layer, ids, q, k, v)
            assert np.array_equal(a, b), f"step {step} layer {layer}"
            if step in (0, gen - 1, gen + 9):
                check(held, mirror, layer, ids, q, b, "bf16")
    assert held.bytes_committed() == plain.bytes_committed()  # past the reservation both count the same pages
    for s in ids:
        assert held.free(s)
    assert held.bytes_used() == 0 and held.num_seqs() == 0


def test_reserve_counts_pages_held_and_refuses_past_capacity():
    L, Hkv, D = 2, 2, 64
    P = KVStore(1, Hkv, D, "bf16", threads=1).page_tokens
    page = 2 * P * D * 2                                      # one head's K and V run
    st = KVStore(L, Hkv, D, "bf16", threads=1, capacity_bytes=10 * L * Hkv * page)
    st.extent_pages = 1                                       # page-exact accounting (extents: test_kv_extents)
    z = np.zeros((3 * P, Hkv, D), np.float32)
    st.append(0, [7] * (2 * P), z[: 2 * P], z[: 2 * P])        # 2 pages per head at layer 0
    assert st.bytes_used() == 2 * Hkv * page
    assert st.reserve([7], [3 * P])                           # layer 0: 1 more page, layer 1: 3
    assert st.bytes_used() == 6 * Hkv * page and st.num_tokens(7, 0) == 2 * P and st.num_tokens(7, 1) == 0
    assert st.reserve([7], [P])                               # less than held: nothing changes
    assert st.bytes_used() == 6 * Hkv * page
    # in head pages: capacity 40, held 12; two new sequences of 5 pages per (layer, head) need 40
    assert not st.reserve([8, 9], [5 * P, 5 * P])             # refused whole
    assert st.num_seqs() == 1 and st.bytes_used() == 6 * Hkv * page
    assert st.reserve([8], [7 * P])                           # 12 + 2 * 2 * 7 = 40: exactly full
    assert st.bytes_used() == st.capacity_bytes
    st.append(1, [7] * (3 * P), z, z)                         # lands in the reserved pages: no new page
    assert st.bytes_used() == st.capacity_bytes
    with pytest.raises(ValueError):
        st.reserve([1, 2], [P])
    with pytest.raises(ValueError):
        st.reserve([1], [-1])


@pytest.mark.parametrize("ranks", [None, 2], ids=["local", "mpiexec-n2"])
@pytest.mark.parametrize("kv_reserve", ["full", "grow"])
def test_rworker_holds_what_placement_reserves(tmp_path, ranks, kv_reserve):
    """Under --kv-reserve full the R-worker holds the sequence's whole reservation from its first
    decode step (prompt + max_tokens in whole pages), not only the pages its tokens fill; under
    grow, the pages its tokens fill."""
    max_tokens = 100
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "The sky is", "max_tokens": max_tokens, "temperature": 0,
                                    "ignore_eos": True}) + "\n")
    stats = tmp_path / "stats.json"
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--quiet",
                           "--kv-reserve", kv_reserve, "--kv-dtype", "bf16", "--stats-json", str(stats)], ranks=ranks, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(stats.read_text())
    steps = [s for s in data["steps"] if "kv_bytes" in s and "s_time_s" in s]
    prompt = steps[0]["kv_tokens"][0] - 1                        # the first decode step holds prompt + 1
    probe = KVStore(1, 3, 64, "bf16", threads=1)              # smollm2-135m: 30 layers x 3 kv heads x 64
    per_token, P = probe.kv_bytes_per_token() * 30, probe.page_tokens

    def pages(tokens):
        return -(-tokens // P) * P * per_token

    live = [s for s in steps if s["kv_tokens"][0] > 0]        # (the last step's row comes after the free)
    assert len(live) >= max_tokens - 2
    for s in live:
        held = pages(prompt + max_tokens) if kv_reserve == "full" else pages(s["kv_tokens"][0])
        assert [b for b in s["kv_bytes"] if b] == [held], s        # on whichever worker holds it
    assert pages(prompt + max_tokens) > pages(prompt + 1)     # the case tells the two apart


def test_reserve_pages_knob_turns_reservation_off(monkeypatch):
    """FASTDECODE_RESERVE_PAGES=0 (a measurement knob): reserve takes nothing, appends still work."""
    monkeypatch.setenv("FASTDECODE_RESERVE_PAGES", "0")
    st = KVStore(1, 2, 64, "bf16", threads=1)
    assert not st.reserve([1], [10 * st.page_tokens])
    assert st.bytes_used() == 0 and st.num_seqs() == 0
    st.append(0, [1], np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float32))
    assert st.bytes_committed() == 2 * 2 * st.page_tokens * 64 * 2
