"""Generation lengths learnt from finished sequences (Kaplan-Meier) and the expected projection."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.sched.admission import _grid, largest_prefix_expected, projected_workload
from fastdecode.sched.length_model import LengthModel


def model_of(obs, min_events=1):
    m = LengthModel(min_events=min_events)
    for length, stopped in obs:
        m.observe(length, stopped)
    return m


def test_kaplan_meier_by_hand():
    # EOS after 2, 4, 5 tokens; one reached its bound of 3 (so its natural length is > 3).
    # x=2: 4 at risk, 1 stops -> 3/4. x=3: 3 at risk, none stops (the bound is no stop).
    # x=4: 2 at risk, 1 stops -> 3/8. x=5: 1 at risk, 1 stops -> 0.
    m = model_of([(2, True), (3, False), (4, True), (5, True)])
    assert m.survival(np.arange(7)).tolist() == [1, 1, 0.75, 0.75, 0.375, 0, 0]


def test_without_censoring_the_curve_is_the_empirical_one():
    lengths = np.random.default_rng(0).integers(1, 40, 500)
    m = model_of([(int(x), True) for x in lengths])
    x = np.arange(45)
    assert np.allclose(m.survival(x), [(lengths > v).mean() for v in x])


@given(st.lists(st.integers(1, 30), min_size=1, max_size=60), st.integers(1, 40))
def test_mean_len_is_the_empirical_mean_of_the_bounded_length(lengths, bound):
    """E[min(L, m)] from the curve against the observed lengths themselves."""
    m = model_of([(x, True) for x in lengths])
    assert m.mean_len(np.array([bound])) == pytest.approx(np.minimum(lengths, bound).mean())


@given(st.lists(st.integers(1, 30), min_size=1, max_size=60),
       st.lists(st.tuples(st.integers(0, 35), st.integers(1, 40)), min_size=1, max_size=8))
def test_expected_length_is_the_conditional_mean_of_the_bounded_length(lengths, seqs):
    """E[min(L, m) | L > g] against the observed lengths themselves: the mean of min(L, m) over
    those longer than g; a sequence older than every one seen keeps its bound."""
    m = model_of([(x, True) for x in lengths])
    g, bound = np.array(seqs).T
    want = [np.minimum(np.array(lengths)[np.array(lengths) > gi], mi).mean() if max(lengths) > gi else mi
            for gi, mi in zip(g, bound)]
    assert m.expected_length(g, bound) == pytest.approx(want)


def test_nothing_is_learnt_when_nothing_stopped_early():
    m = model_of([(50, False)] * 40, min_events=16)          # every sequence hit max_tokens
    assert not m.ready
    assert m.mean_len(np.array([50])) is None and m.length_biased_mean(np.array([50])) is None


def test_length_biased_mean_by_hand():
    m = model_of([(10, True), (30, True)])
    # bounds >= 30 see the raw lengths: (10^2 + 30^2) / (10 + 30) = 25
    assert m.length_biased_mean(np.array([30, 100])) == pytest.approx(25.0)
    # bound 20: min(L, 20) is 10 or 20, each with probability 1/2: (100 + 400) / (10 + 20)
    assert m.length_biased_mean(np.array([20])) == pytest.approx(500 / 30)


def test_window_forgets_old_sequences():
    m = LengthModel(window=100, min_events=1)
    for _ in range(100):
        m.observe(500, True)
    for _ in range(100):
        m.observe(20, True)
    assert m.survival(np.array([19, 20])).tolist() == [1.0, 0.0]


def brute_expected(model, running, t_max):
    sv = lambda x: float(model.survival(np.array([x]))[0])
    out = []
    for t in range(t_max):
        tot = 0.0
        for kv, left, g in running:
            if t < left:
                ratio = sv(g + t) / sv(g) if sv(g) > 0 else 1.0
                tot += (kv + t + 1) * ratio
        out.append(tot)
    return np.array(out)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 25), st.booleans()), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 30), st.integers(1, 25), st.integers(0, 30)), max_size=12))
def test_expected_curve_matches_brute_force(obs, running):
    m = model_of(obs)
    if not m.ready:
        return
    arr = np.array(running, dtype=np.int64).reshape(-1, 3)
    got = m.expected_curve(arr[:, 0], arr[:, 2], arr[:, 1], np.arange(30))
    assert np.allclose(got, brute_expected(m, running, 30))


def test_expected_curve_is_the_bound_projection_when_everyone_lives_past_the_bound():
    m = model_of([(100, True)] * 20)
    kv, left = np.array([5, 9, 0]), np.array([7, 3, 12])
    got = m.expected_curve(kv, np.zeros(3, np.int64), left, np.arange(12))
    assert np.allclose(got, projected_workload(kv, left, 12))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(0, 30)), max_size=10),
       st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40)), min_size=1, max_size=10),
       st.integers(0, 600))
def test_largest_prefix_expected_is_the_largest_feasible_prefix(lengths, running, items, w_lim):
    """Brute force over every prefix at every step (horizons here are within the exact grid)."""
    m = model_of([(x, True) for x in lengths])
    run = np.array(running, dtype=np.int64).reshape(-1, 3)
    new = np.array(items, dtype=np.int64)
    k = largest_prefix_expected(m, run, new, w_lim, len(items))
    horizon = 45
    assert _grid(horizon).tolist() == list(range(horizon))

    def peak(j):
        as_running = [(p, mt, 0) for p, mt in items[:j]]
        return brute_expected(m, running + as_running, horizon).max(initial=0.0)

    feasible = [j for j in range(len(items) + 1) if peak(j) <= w_lim + 1e-9]
    assert k == (max(feasible) if 0 in feasible else 0)
