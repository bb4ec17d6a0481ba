"""Placement with sliding-window layers: a sequence is charged, per layer, the pages its window
keeps live (hand-computed here), so a windowed model admits more long sequences on the same
memory; reservations and releases balance under both reservation policies."""
from __future__ import annotations

import math

import pytest

PAGE = 32


def make_seq(seq_id, prompt_len, max_tokens):
    from fastdecode.engine.sampling_params import SamplingParams
    from fastdecode.engine.sequence import Request, Sequence
    req = Request(seq_id, str(seq_id), None, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0)
    seq = Sequence(seq_id, req, 0, max_tokens)
    req.sequences.append(seq)
    return seq


def placement(cap_tokens, windows=(), policy="full"):
    from fastdecode.rpart.base import WorkerInfo
    from fastdecode.sched.placement import Placement
    return Placement([WorkerInfo(1, "h", 1, "avx2", cap_tokens * 8, page_tokens=PAGE)], 8, policy=policy,
                     windows=windows)


GEMMA = (512, 512, 512, 512, 512, 0)       # 5 of 6 layers sliding


@pytest.mark.parametrize("tokens", [1, 31, 32, 500, 577, 8192])
def test_charge_is_the_live_pages_averaged_over_layers(tokens):
    p = placement(10 ** 6, GEMMA)
    pages = math.ceil(tokens / PAGE)
    by_hand = (5 * min(pages, 512 // PAGE + 1) + pages) * PAGE / 6
    assert p._charge(0, tokens) == math.ceil(by_hand)
    assert placement(10 ** 6)._charge(0, tokens) == pages * PAGE          # no windows: whole pages


def test_all_full_windows_are_no_windows():
    assert placement(100, (0, 0, 0)).windows == ()


def test_a_windowed_model_admits_more_long_sequences():
    cap = 40_000
    full, windowed = placement(cap), placement(cap, GEMMA)
    n_full = n_win = 0
    while full.place(make_seq(n_full, 8000, 192)) is not None:
        n_full += 1
    while windowed.place(make_seq(n_win, 8000, 192)) is not None:
        n_win += 1
    per_full = math.ceil(8192 / PAGE) * PAGE
    per_win = math.ceil((5 * (512 // PAGE + 1) + 8192 // PAGE) * PAGE / 6)
    assert n_full == cap // per_full and n_win == cap // per_win
    assert n_win >= 3 * n_full


def test_a_request_too_long_for_full_attention_fits_with_windows():
    seq = make_seq(0, 30_000, 1000)
    # 31,008 tokens of pages on a full layer; 1,056 on a window of 1,024 (its pages + 1)
    assert not placement(3000).fits_anywhere_alone(seq)
    assert not placement(3000, (1024,) * 11 + (0,)).fits_anywhere_alone(seq)    # 2,584 + 968 > 3,000
    assert placement(3000, (1024,) * 12).fits_anywhere_alone(seq)


def test_grow_reserves_and_releases_balance():
    p = placement(100_000, GEMMA, policy="grow")
    seqs = [make_seq(i, 600 + 37 * i, 400) for i in range(6)]
    for s in seqs:
        assert p.place(s) == 0
    for _ in range(300):
        for s in seqs:
            s.output_ids.append(5)
            if p.needs_growth(s):
                assert p.grow(s)
    held = sum(p._charge(0, p.held_tokens(s)) for s in seqs)
    assert p.reserved[0] == held
    # a windowed layer's charge stops growing: the last 300 steps cost only the full layer's pages
    for s in seqs:
        p.release(s)
    assert p.reserved == [0] and p.resident == [0] and p.load[0] == pytest.approx(0.0, abs=1e-6)
