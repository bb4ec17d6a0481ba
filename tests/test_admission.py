"""Admission controllers: workload limit, fairness, refill, ramp, FIFO vs stabilized."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.sched.admission import FifoAdmission, StabilizedAdmission, projected_workload
from fastdecode.sched.simulate import earliest_step, simulate

SETTINGS = settings(max_examples=60, deadline=None)


def brute_projection(running, horizon):
    return [sum(k + t + 1 for k, left in running if t < left) for t in range(horizon)]


@st.composite
def workloads(draw, max_n=50):
    """Random requests: (prompt, max_tokens), EOS steps <= max_tokens, arrival steps."""
    n = draw(st.integers(1, max_n))
    max_gen = draw(st.integers(1, 80))
    reqs = [(draw(st.integers(0, 60)), draw(st.integers(1, max_gen))) for _ in range(n)]
    eos = [draw(st.integers(1, m)) for _, m in reqs]
    arrivals = [draw(st.integers(0, 150)) for _ in range(n)]
    return reqs, eos, arrivals


# ---- projection and GETEARLIESTSTEP against brute force

@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), max_size=12))
def test_projection_matches_brute_force(running):
    arr = np.array(running, dtype=np.int64).reshape(-1, 2)
    got = projected_workload(arr[:, 0], arr[:, 1], horizon=35)
    assert got.tolist() == brute_projection(running, 35)


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20)), max_size=8),
       st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20)), min_size=1, max_size=4),
       st.integers(1, 400))
def test_earliest_step_is_first_feasible_offset(running, items, w_lim):
    d = earliest_step(running, items, w_lim)
    horizon = 60

    def peak_at(offset):
        shifted = [(k + offset, left - offset) for k, left in running if left > offset]
        return max(brute_projection(shifted + items, horizon))

    feasible = [o for o in range(horizon) if peak_at(o) <= w_lim]
    if feasible:
        assert d == feasible[0]
    else:   # too big even alone: starts when nothing runs any more
        assert d == max([left for _, left in running], default=0)


# ---- the stabilized controller in simulation

@SETTINGS
@given(workloads(), st.integers(1, 16), st.integers(1, 10), st.integers(50, 2000))
def test_workload_never_exceeds_w_lim_but_for_a_lone_oversized_request(wl, B, F, w_lim):
    """With the bound projection W_lim is a hard limit (with learnt lengths it bounds the
    expected projection, and capacity the worst case: the next test)."""
    reqs, eos, arrivals = wl
    ctl = StabilizedAdmission(B, admit_every=F, w_lim=w_lim, learn_lengths=False)
    r = simulate(ctl, reqs, eos, arrivals)
    assert (r.finished >= 0).all()                       # everyone served
    over = r.workload > w_lim
    # the only excess allowed: one request bigger than W_lim admitted into an empty system
    assert (r.running[over] == 1).all()
    oversized = {i for i, (p, m) in enumerate(reqs) if p + m > w_lim}
    for t in np.flatnonzero(over):
        alone = np.flatnonzero((r.admitted <= t) & (r.finished >= t))
        assert len(alone) == 1 and alone[0] in oversized


@SETTINGS
@given(workloads(), st.integers(1, 16), st.integers(1, 10), st.integers(50, 2000), st.integers(80, 3000))
def test_learnt_lengths_never_exceed_capacity(wl, B, F, w_lim, capacity):
    """Learnt lengths may let the workload pass W_lim (a target in expectation), never the
    capacity: KV cannot be preempted, so the worst case is still checked against it."""
    reqs, eos, arrivals = wl
    ctl = StabilizedAdmission(B, admit_every=F, w_lim=w_lim)
    ctl.lengths.min_events = 2           # learn from the first stops of these small sets
    r = simulate(ctl, reqs, eos, arrivals, capacity_tokens=capacity)
    assert (r.finished >= 0).all()
    over = r.workload > capacity
    assert (r.running[over] == 1).all()  # only a lone request bigger than capacity
    assert (r.running <= B).all()


@SETTINGS
@given(workloads(), st.integers(1, 16), st.booleans())
def test_default_w_lim_bounds_the_workload_until_the_next_admission(wl, B, ramp):
    """With estimated S and prompt mean W_lim moves; the projection made at each admission
    still bounds the workload until the next one (bound projection)."""
    reqs, eos, arrivals = wl
    r = simulate(StabilizedAdmission(B, ramp=ramp, learn_lengths=False), reqs, eos, arrivals)
    ok = (r.workload <= r.w_lim) | (r.running == 1)
    assert ok.all()
    assert (r.running <= B).all()


@SETTINGS
@given(workloads(), st.integers(1, 16), st.integers(1, 10))
def test_head_of_queue_waits_at_most_max_tokens(wl, B, F):
    """FIFO bound: while the head waits nobody else starts, the running sequences end within
    max_tokens steps, and an empty system admits the head. So no one waits forever: request i
    waits at most (its queue position + 1) * max_tokens steps."""
    reqs, eos, arrivals = wl
    for ctl in (StabilizedAdmission(B, admit_every=F), FifoAdmission(B)):
        r = simulate(ctl, reqs, eos, arrivals)
        bound = max(m for _, m in reqs)
        assert (r.head_since >= r.arrival).all()
        assert (r.admitted - r.head_since <= bound).all()
        # FIFO: admission order follows arrival order
        order = np.lexsort((np.arange(len(reqs)), r.arrival))
        assert (np.diff(r.admitted[order]) >= 0).all()


@SETTINGS
@given(st.integers(2, 24), st.integers(8, 64), st.integers(1, 8), st.integers(0, 2 ** 32 - 1),
       st.integers(1, 64))
def test_slots_freed_at_eos_are_refilled_at_once(B, S, F, seed, eos_max):
    n = B * (S + 4)         # enough to outlast the ramp even if everything ends after one step
    eos = np.random.default_rng(seed).integers(1, min(eos_max, S) + 1, n)
    r = simulate(StabilizedAdmission(B, admit_every=F, max_gen=S, w_lim=1e12), [(5, S)] * n, eos)
    full = np.flatnonzero(r.running == B)
    assert full.size                                     # the ramp reaches B
    after = np.arange(len(r.running)) >= full[0]
    queued = r.waiting > 0                               # requests left over after admission
    assert (r.running[after & queued] == B).all()


@pytest.mark.parametrize("B,S,F", [(64, 256, 16), (32, 100, 7), (10, 40, 1)])
def test_ramp_opens_at_most_one_micro_batch_per_F_steps(B, S, F):
    ctl = StabilizedAdmission(B, admit_every=F, max_gen=S)
    r = simulate(ctl, [(0, S)] * (3 * B))
    M = ctl.describe()["micro_batch"]
    assert M == max(1, round(B * F / S))
    steps = np.arange(S)                                 # nothing finishes before step S
    assert (np.cumsum(r.admitted_now[:S]) <= M * (steps // F + 1)).all()
    # without the ramp the first step takes as many as W_lim allows: the start-up spike
    spike = simulate(StabilizedAdmission(B, admit_every=F, max_gen=S, ramp=False), [(0, S)] * (3 * B))
    assert spike.admitted_now[0] > M


def test_burst_after_idle_ramps_up_again():
    B, S, F = 32, 64, 8
    reqs = [(0, S)] * 64
    arrivals = [0] * 32 + [1000] * 32                    # queue empty long before the burst
    ctl = StabilizedAdmission(B, admit_every=F, max_gen=S)
    r = simulate(ctl, reqs, arrivals=arrivals)
    assert r.admitted_now[1000] == ctl.describe()["micro_batch"]


def test_steady_stream_workload_is_flat_for_stabilized_and_a_sawtooth_for_fifo():
    """Equal lengths, a long queue: a fixed batch restarts together every S steps (workload
    from B to B*S, CV ~ 1/sqrt(3)); the stabilized schedule keeps it between B(S-F)/2 and
    W_lim = B(S+F)/2 once ramped."""
    B, S, F = 64, 256, 16
    reqs = [(0, S)] * (12 * B)
    stab = simulate(StabilizedAdmission(B, admit_every=F, max_gen=S), reqs)
    fifo = simulate(FifoAdmission(B), reqs)

    def steady(r):
        w = r.workload[(r.waiting > 0)][S:]              # after the ramp, while saturated
        return w, w.std() / w.mean()

    w_stab, cv_stab = steady(stab)
    w_fifo, cv_fifo = steady(fifo)
    assert w_stab.max() <= B * (S + F) / 2
    assert w_stab.min() >= B * (S - F) / 2
    assert cv_stab < 0.05 < 0.5 < cv_fifo
    assert w_fifo.max() == B * S                         # the spike the schedule removes
    assert abs(w_stab.mean() - w_fifo.mean()) / w_fifo.mean() < 0.02   # same mean load


def test_lone_oversized_request_is_admitted_and_then_the_queue_moves():
    ctl = StabilizedAdmission(4, admit_every=1, w_lim=100)
    r = simulate(ctl, [(200, 10), (5, 5), (5, 5)])
    assert r.admitted[0] == 0
    assert r.admitted[1] == r.finished[0] + 1            # waits for the big one, then starts
    assert (r.finished >= 0).all()


def test_capacity_caps_w_lim_and_the_workload():
    ctl = StabilizedAdmission(64, admit_every=4, max_gen=100, w_lim=1e9)
    r = simulate(ctl, [(10, 100)] * 200, capacity_tokens=2000)
    assert ctl.describe()["w_lim"] == 2000
    assert r.workload.max() <= 2000


@pytest.mark.parametrize("capacity,prompt,gen", [(2184, 32, 512), (4369, 32, 512), (8000, 200, 256),
                                                   (12000, 32, 512), (16000, 200, 256)])
def test_memory_smaller_than_the_target_batch_keeps_ages_spread(capacity, prompt, gen):
    """A target batch that memory cannot hold: the schedule spreads the batch that fits (one
    micro-batch of it every F steps) instead of sizing micro-batches for the target. Sized for
    the target (B = 64), the refused micro-batches started together later and the run fell
    into a few groups of one age: at least 4, 8, 17, 22 and 35 running for these settings,
    against a fit of capacity / (prompt + (S + F)/2) = 6.7, 14.3, 24, 39.9 and 47.6. Now 6, 14,
    23, 39 and 47, the fit rounded down, steadily, and never over capacity."""
    ctl = StabilizedAdmission(64)
    r = simulate(ctl, [(prompt, gen)] * 200, capacity_tokens=capacity)
    saturated = (r.waiting > 0) & (np.arange(len(r.running)) >= gen)   # past the ramp, queue not empty
    d = ctl.describe()
    fit = capacity / (prompt + (gen + d["admit_every"]) / 2)
    assert d["batch_spread"] <= fit < 64
    assert r.running[saturated].min() >= math.floor(fit) - 1
    assert r.workload.max() <= capacity


def test_grow_page_overhead_counts_against_capacity_not_w_lim():
    """Under --kv-reserve grow a sequence holds its last page half full, the next token's slot and
    a page of admission headroom beyond its tokens: 48.5 tokens at 32-token pages. Capacity
    holds fewer sequences by that, and the tokens the projection may reach leave room for it."""
    from fastdecode.rpart.base import WorkerInfo
    from fastdecode.sched.placement import Placement

    workers = [WorkerInfo(1, "h", 1, "avx2", 10 ** 6, page_tokens=32)]
    assert Placement(workers, 8, policy="grow").seq_overhead_tokens() == 48.5
    assert Placement(workers, 8, policy="full").seq_overhead_tokens() == 0.0
    ctl = StabilizedAdmission(64, seq_overhead_tokens=48.5)
    r = simulate(ctl, [(16, 384)] * 200, capacity_tokens=2912)
    d = ctl.describe()
    B, F = d["batch_spread"], d["admit_every"]
    assert B == math.floor(2912 / (16 + (384 + F) / 2 + 48.5)) == 10      # 13 without the overhead
    assert d["w_lim"] == 2912 - 48.5 * B
    saturated = (r.waiting > 0) & (np.arange(len(r.running)) >= 384)
    assert r.running[saturated].min() == B
    assert (r.workload + 48.5 * r.running).max() <= 2912


@pytest.mark.parametrize("B, S", [(64, 100), (100, 333), (16, 50), (8, 30), (48, 200)])
def test_equal_lengths_keep_the_target_batch_running(B, S):
    """S/F is rarely whole (F = ceil(S/16)), so the ramp's groups slip against the even ages that
    W_lim's steady-state term assumes. Without W_lim's micro-batch of slack the projection refused
    the slipped group, it started with the next, and equal lengths kept the lump: 48, 69, 13, 7
    and 35 running on average for these settings, workload CV 0.11-0.40."""
    ctl = StabilizedAdmission(B)
    r = simulate(ctl, [(32, S)] * (8 * B))
    saturated = (r.waiting > 0) & (np.arange(len(r.running)) >= S)
    w = r.workload[saturated]
    assert r.running[saturated].mean() >= 0.95 * B
    assert w.std() / w.mean() < 0.1
    assert (r.workload <= r.w_lim).all()


def test_defaults_estimate_s_from_max_tokens_and_include_prompts_in_w_lim():
    ctl = StabilizedAdmission(8)
    waiting = [(100, 10), (100, 30)] * 4
    k = ctl.admit(0, waiting, [])
    d = ctl.describe()
    # length-biased mean (W_lim's growth term): (10^2 + 30^2) / (10 + 30) = 25; mean (the
    # ramp's rate): 20, so F = ceil(20 / 16) = 2 and M = round(8 * 2 / 20) = 1
    assert d["max_gen"] == 25 and d["mean_gen"] == 20 and d["admit_every"] == 2
    assert d["micro_batch"] == 1
    assert d["w_lim"] == 8 * (100 + (25 + 2) / 2) + 1 * (100 + 25)      # + one micro-batch at full length
    assert k == 1                                        # one micro-batch of slots at start-up


def test_fifo_fills_to_max_batch_and_respects_capacity():
    fifo = FifoAdmission(4)
    assert fifo.admit(0, [(1, 1)] * 10, [(3, 2)]) == 3
    # capacity 30. Running (3, 2) holds [4, 5] tokens in the next two steps; a new (5, 5)
    # holds [6, 7, 8, 9, 10]. Three new: t=1 -> 5 + 3*7 = 26, t=4 -> 3*10 = 30 <= 30.
    # Four new: t=4 -> 40 > 30. So three (max_batch room is also 3).
    assert fifo.admit(0, [(5, 5)] * 10, [(3, 2)], capacity_tokens=30) == 3
    assert fifo.admit(0, [(5, 5)] * 10, [(3, 2)], capacity_tokens=29) == 2
    assert fifo.admit(0, [(500, 5)], [], capacity_tokens=30) == 1     # alone: never deadlock


@pytest.mark.parametrize("ctl", [StabilizedAdmission(8, admit_every=2), FifoAdmission(8)])
def test_admits_a_prefix_no_larger_than_the_queue(ctl):
    for step, n_wait, n_run in itertools.product(range(4), range(4), range(10)):
        k = ctl.admit(step, [(3, 7)] * n_wait, [(4, 4)] * n_run)
        assert 0 <= k <= n_wait


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_lengths_with_varied_prompts_stay_stabilized(seed):
    """The paper's setting: every request generates S tokens, prompts differ (16-64 tokens). The
    load must stay flat with B running, not fall apart into fixed batches of fewer sequences
    (which a W_lim at the bare mean projected peak did: refused micro-batches refill together)."""
    B, S = 64, 256
    rng = np.random.default_rng(seed)
    reqs = [(int(p), S) for p in rng.integers(16, 65, 24 * B)]
    stab = simulate(StabilizedAdmission(B), reqs)
    fifo = simulate(FifoAdmission(B), reqs)
    saturated = stab.waiting > 0
    after_ramp = np.arange(len(stab.running)) >= 2 * S
    w = stab.workload[saturated & after_ramp]
    assert w.size > 10 * S
    assert (stab.running[saturated & after_ramp] == B).all()
    w_fifo = fifo.workload[fifo.waiting > 0]
    assert w.std() / w.mean() < 0.06 < 0.4 < w_fifo.std() / w_fifo.mean()
    assert len(stab.running) <= 1.05 * len(fifo.running)          # the ramp is all it costs


@pytest.mark.parametrize("seed", [0, 1])
def test_early_eos_learnt_lengths_keep_the_batch_full(seed):
    """max_tokens 256 but EOS anywhere in 20-256 tokens: projecting every sequence to its bound
    refuses slots the real load has room for; lengths learnt from finished sequences fill
    them, and the load stays as flat as FIFO's. (Before W_lim's micro-batch of slack the bound
    projection ran 30 of 32 here; the slack takes most of that gap, the rest is learnt's.)"""
    B, S = 32, 256
    rng = np.random.default_rng(seed)
    n = 40 * B
    reqs = [(int(p), S) for p in rng.integers(16, 65, n)]
    eos = rng.integers(20, S + 1, n)
    runs = {name: simulate(ctl, reqs, eos) for name, ctl in
            (("learnt", StabilizedAdmission(B)), ("bound", StabilizedAdmission(B, learn_lengths=False)),
             ("fifo", FifoAdmission(B)))}

    def saturated(r):
        keep = (r.waiting > 0) & (np.arange(len(r.running)) >= 2 * S)
        return r.running[keep], r.workload[keep]

    run_l, w_l = saturated(runs["learnt"])
    run_b, _ = saturated(runs["bound"])
    _, w_f = saturated(runs["fifo"])
    assert run_l.size > 4 * S
    assert run_b.mean() < 0.995 * B <= run_l.mean()
    assert w_l.std() / w_l.mean() <= 1.05 * w_f.std() / w_f.mean()
    assert len(runs["learnt"].running) < len(runs["bound"].running)


def test_scheduler_reports_ages_and_finished_sequences_to_the_controller():
    """The engine's side of learnt lengths: running sequences carry their age, and every
    finished one is observed (EOS stop vs max_tokens) but not one aborted without a reason."""
    from fastdecode.engine.sampling_params import SamplingParams
    from fastdecode.engine.sequence import Request, Sequence
    from fastdecode.rpart.base import WorkerInfo
    from fastdecode.sched.placement import Placement
    from fastdecode.sched.scheduler import Scheduler

    class Spy(StabilizedAdmission):
        def admit(self, step, waiting, running, capacity_tokens=None):
            self.last_running = list(running)
            return super().admit(step, waiting, running, capacity_tokens)

    ctl = Spy(4, admit_every=1, max_gen=8, ramp=False)
    sched = Scheduler(ctl, Placement([WorkerInfo(1, "h", 1, "avx2", 10 ** 9)], 64), 4, 10 ** 6)
    seqs = [Sequence(i, Request(i, str(i), None, [1] * (3 + i), SamplingParams(max_tokens=8), 0), 0, 8)
            for i in range(6)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule_prefill(0)
    assert len(first) == 4
    for n, s in zip((2, 8, 5, 1), first):
        s.output_ids = [7] * n
    first[0].finish_reason = "stop"          # EOS after 2 tokens
    first[1].finish_reason = "length"        # ran to max_tokens
    for s in first[:3]:                      # first[2] has no reason: aborted, not a length sample
        sched.finish(s)
    sched.drop_finished()
    sched.schedule_prefill(1)
    assert ctl.last_running == [(3 + 3 + 0, 8 - 1, 1)]       # kv, tokens left, tokens generated
    obs = ctl.lengths
    assert obs.describe()["finished_seen"] == 2 and obs.describe()["eos_stops"] == 1
    assert sorted(zip(obs._length[:2].tolist(), obs._stopped[:2].tolist())) == [(2, True), (8, False)]


@pytest.mark.parametrize("flag,learns", [([], True), (["--stabilize-lengths", "max-tokens"], False)])
def test_stabilize_lengths_flag_reaches_the_controller(flag, learns):
    from types import SimpleNamespace

    from fastdecode.cli import build_parser, engine_args
    from fastdecode.engine.llm_engine import LLMEngine

    args = build_parser().parse_args(["generate", "-i", "in.jsonl", "-o", "out.jsonl", "--schedule", "stabilized",
                                 "--max-batch", "64"] + flag)
    ea = engine_args(args)
    assert ea.learn_lengths is learns
    ctl = LLMEngine._make_admission(SimpleNamespace(args=ea, placement=SimpleNamespace(seq_overhead_tokens=lambda: 0.0)))
    assert (ctl.lengths is not None) is learns
