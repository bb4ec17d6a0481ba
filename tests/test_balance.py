"""The balance rule (fastdecode/sched/balance.py): a sequence starts only while it raises tokens/s.

Unit checks on a toy placement (the step model, the marginal test, where a sequence goes, what is
learnt from a step), and through the simulator on stated hardware: one H100 with its own KV tier
and a few CPU sockets never runs behind the card alone, where memory-bound admission (the rule
before, `balance=False`) ran at a third of it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastdecode.sched.admission import StabilizedAdmission
from fastdecode.sched.balance import BatchCurve, StepBalance, follow_balance
from fastdecode.sched.placement import Placement
from fastdecode.sim.core import SimConfig, simulate
from fastdecode.sim.costs import costs_of
from fastdecode.sim.trace import synthetic_trace
from fastdecode.sizing.plan import build_profile


def seq(i: int, prompt: int = 100, max_tokens: int = 100):
    return SimpleNamespace(seq_id=i, prompt_len=prompt, max_tokens=max_tokens, kv_len=prompt,
                           total_len_bound=prompt + max_tokens, worker=-1)


def toy(r_speeds=(1e5,), tier_speed: float | None = 1e6, tier_tokens: int = 10**9, depth: int = 2,
        s_part: float = 0.01) -> StepBalance:
    """R-workers at r_speeds tokens/s (roomy), a tier at tier_speed holding tier_tokens, an S-part
    of s_part seconds at any batch; the step model attached to placement."""
    workers = [SimpleNamespace(capacity_bytes=10**12, page_tokens=1, frees_windows=True) for _ in r_speeds]
    speeds = list(r_speeds)
    tier = None
    if tier_speed is not None:
        workers.append(SimpleNamespace(capacity_bytes=tier_tokens, page_tokens=1, frees_windows=True))
        speeds.append(tier_speed)
        tier = len(workers) - 1
    p = Placement(workers, kv_bytes_per_token=1, bandwidth=speeds)
    b = StepBalance(p, depth, tier).attach()
    for rows in (1, 1000):
        b.s_curve.observe(rows, s_part)
    return b


def fill(b: StepBalance, n: int, start: int = 0) -> int:
    """Offer n sequences in turn; -> how many the rule started."""
    started = 0
    for i in range(start, start + n):
        s = seq(i)
        if not b.admits(s):
            break
        assert b.placement.place(s) is not None
        started += 1
    return started


def test_batch_curve_interpolates_and_extends_along_the_last_slope():
    c = BatchCurve()
    assert c(10) == 0.0 and not c.known
    c.observe(16, 1.0)
    assert c(1) == c(100) == 1.0                       # one point: flat
    c.observe(64, 2.0)
    assert c(40) == pytest.approx(1.5) and c(1) == 1.0
    assert c(112) == pytest.approx(3.0)                # past the last point along its slope
    c.observe(128, 1.9)                                # a falling last segment extends flat
    assert c(1000) == pytest.approx(1.9)


def test_r_worker_fills_to_its_balance_point_then_the_queue_waits():
    """A slow R-worker (1e5 tokens/s), a tier with room for 3 sequences, an S-part of 10 ms: the
    tier takes the first three (placed where the step grows least), the R-worker then takes
    sequences while its attention fits in the S-side's time or the longer step still pays: 150
    tokens each (prompt + half the bound) at 1e5/s is 1.5 ms, so 10 ms (plus the tier's 0.45 ms)
    hold 6 of them; a 7th and 8th stretch the step (a mini-batch's dense half, then its share of
    the R-worker's: 5 + 0.75 n + 0.75 ms; then the R-worker's own 1.5 n ms) by less than they add
    (9 / 10.45 < 10 / 11.0 < 11 / 12.0 ms); the 9th would not (12 / 13.5 ms), with memory for thousands."""
    b = toy(tier_tokens=3 * 200)
    started = fill(b, 100)
    p = b.placement
    assert p.resident == [8, 3] and started == 11
    assert b.refused == 1
    assert b.step_time(p.load, p.resident) == pytest.approx(0.012)


def test_without_a_tier_every_sequence_an_r_bound_pool_holds_pays():
    """R-workers alone: tokens/s stays level as they bind (each sequence adds its own time), so
    the rule never holds the queue back: memory bounds the batch, as before."""
    b = toy(r_speeds=(1e5, 1e5, 5e4), tier_speed=None)
    assert fill(b, 400) == 400 and b.refused == 0


def test_the_marginal_test_allows_a_longer_step_that_buys_more():
    """Once the R-workers bind, one more sequence there is refused while the tier holds others:
    (B + 1) / T(B + 1) < B / T(B). Where the tier holds nothing, T grows in proportion and it pays."""
    b = toy(tier_tokens=2 * 200)
    fill(b, 100)
    p = b.placement
    rows = sum(p.resident)
    before = b.step_time(p.load, p.resident)
    extra = [150.0, 0.0]
    after = b.times_with(extra)[0]
    assert (rows + 1) / after < rows / before              # what the refusal means
    lone = toy(tier_speed=None)
    assert fill(lone, 50) == 50


def test_depth_one_sends_a_sequence_to_the_tier_when_the_s_worker_would_wait():
    """Depth 1: the S-worker waits for the R-workers' trip each layer, so a sequence goes to the
    tier (0.15 ms more) rather than the slow R-worker (1.5 ms more) while the tier has room."""
    b = toy(depth=1)
    fill(b, 9)
    assert b.placement.resident == [0, 9]           # the tier's 9 x 0.15 ms still below one on the R-worker
    fill(b, 2, start=9)
    assert b.placement.resident == [1, 10]          # past 1.5 ms of tier: the R-worker's trip hides behind it


def test_observe_learns_speeds_the_s_part_and_the_trip():
    b = toy(r_speeds=(1e5,), tier_speed=1e6)
    p = b.placement
    for i in range(4):
        p.place(seq(i), 0)
    # a step: S-side 20 ms of which the tier 0; the R-worker read 400 tokens in 8 ms (5e4/s, half
    # its start-up speed) and the S-worker waited 10 ms
    for _ in range(40):
        b.observe(4, 0.02, [400.0, 0.0], [0.008, 0.0], [0.009, 0.0], r_wait_s=0.01)
    assert p.bandwidth[0] == pytest.approx(5e4, rel=1e-3)
    assert b.s_curve(4) == pytest.approx(0.02)
    assert b.overhead[0] == pytest.approx(0.001, rel=1e-3)
    piece = 0.009 / 2 + 0.009 / 4 / 2              # the heaviest mini-batch's: R / d + one sequence x (1 - 1/d)
    assert b.trip(2) == pytest.approx(0.03 - 0.02 / 2 - piece, rel=1e-3)     # T - s / d - P, 2 rows a mini-batch
    d = b.describe()
    assert d["bound"] == "R" and d["sequences_rworkers"] == 4 and d["sequences_tier"] == 0


def test_follow_balance_sets_the_stabilized_target_within_the_users_limit():
    b = toy(tier_tokens=3 * 200)
    adm = StabilizedAdmission(50)
    follow_balance(adm, b, [(100, 100)] * 10, max_batch=4096)
    assert adm.batch_limit == 50 and 3 <= adm.target_batch <= 12      # the tier's 3 and about 6 on the R-worker
    follow_balance(adm, toy(tier_speed=None), [(100, 100)] * 10, max_batch=4096)
    assert adm.target_batch == 50                                     # memory-bound pool: the user's limit


def run_stated(sockets: int, balance: bool, requests: int = 2000) -> float:
    """Output tokens/s of the simulated job: one H100 and its tier, `sockets` sockets at 350 GB/s
    (75% in the kernel), a 25 GB/s link; Llama-3-8B chats, prompts 900-1,100, outputs 128-1,024."""
    import argparse

    from fastdecode.sim.cli import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args("simulate --model llama-3-8b --gpu-profile h100 --cpu-bw 350 --cpu-eff 0.75 "
                             "--link-bw 25 --link-latency 3".split())
    prof = build_profile(args)
    trace = synthetic_trace(requests, "uniform:900:1100", "uniform:128:1024", None, None, 1)
    cfg = SimConfig(rworkers=sockets, depth=2, schedule="stabilized", max_batch=4096, max_prefill_tokens=8192,
                    balance=balance)
    run = simulate(costs_of(prof, sockets, cfg.max_batch), trace, cfg)
    return float(run.steps["tokens"].sum() / run.steps["t_s"][-1])


def test_one_socket_never_puts_the_job_behind_the_card_alone():
    card = run_stated(0, True)
    one = run_stated(1, True)
    two = run_stated(2, True)
    assert one >= 0.98 * card and two >= 0.98 * max(card, one)
    assert run_stated(1, False) < 0.8 * card          # memory-bound admission: the socket held the job back


def test_the_run_report_says_the_balance_point():
    from fastdecode.batch.report_text import balance_line
    b = toy(tier_tokens=3 * 200)
    fill(b, 100)
    b.observe(11, 0.0105, [1200.0, 450.0], [0.012, 0.0005], [0.0125, 0.0005], r_wait_s=0.0015)
    run = {"balance": {"gates_admission": True, **b.describe()}}
    assert balance_line(run) == ("balance: 3 sequence(s) on the tier, 8 on the R-workers; S-side 10.5 ms, "
                                 "slowest R-worker 12.5 ms a step, bound R; the queue's head held back 1 time(s)")
    assert balance_line({"balance": {"gates_admission": False, **b.describe()}}) is None
    assert balance_line({}) is None


def test_the_progress_line_says_the_balance_point():
    from types import SimpleNamespace

    from fastdecode.batch.progress import Snapshot, engine_snapshot, progress_line
    b = toy(tier_tokens=3 * 200)
    snap = Snapshot(10, 100.0, 1, 4, 11, 0, [1200], [5000])
    assert "bound=" not in progress_line(10.0, snap, 1.0, 1.0, None)       # no rule, or nothing measured yet
    fill(b, 100)
    b.observe(11, 0.0105, [1200.0, 450.0], [0.012, 0.0005], [0.0125, 0.0005], r_wait_s=0.0015)
    snap.balance = b.describe()
    line = progress_line(10.0, snap, 1.0, 1.0, None)
    assert line.endswith(" tier_seqs=3 r_seqs=8 bound=R s_step=0.0105 r_step=0.0125")
    # the engine's snapshot carries it where the scheduler's rule gates admission, and not elsewhere
    engine = SimpleNamespace(scheduler=SimpleNamespace(running=[], waiting=[], balance=b),
                             placement=SimpleNamespace(capacity_tokens=[5000]), num_output_tokens=0, step_no=0)
    assert engine_snapshot(engine, 0, 4, more_expected=None).balance == b.describe()
    engine.scheduler.balance = None
    assert engine_snapshot(engine, 0, 4, more_expected=None).balance is None


def test_lumpy_r_workers_take_a_whole_round_that_pays():
    """Four slow R-workers (1e5 tokens/s: a 150-token sequence is 1.5 ms) beside a tier holding
    one sequence, an S-part of 2 ms, one pipeline stage: with one sequence each the step is the
    S-part, then the longer of the tier's and the R-side's part; a fifth R-sequence puts two on
    one worker, a whole sequence's time more (tokens/s falls: it does not pay alone), but the
    round of four that brings every worker to two does pay, so the rule starts it."""
    b = toy(r_speeds=(1e5,) * 4, tier_tokens=200, depth=1, s_part=0.002)
    p = b.placement
    for i in range(5):                                  # the tier's one, then one on each R-worker
        assert p.place(seq(i), worker=4 if i == 0 else i - 1) is not None
    assert p.resident == [1, 1, 1, 1, 1]
    nxt = seq(99)
    w = p.best(nxt)
    extra = [0.0] * 5
    extra[w] = p.projected_load(nxt, w)
    before = b.step_time(p.load, p.resident, s_rows=6)
    assert 6 * before < 5 * b.times_with(extra)[w]      # one more alone: tokens/s falls
    k, t_round = b._level_fill(w, extra[w])
    assert k == 4 and 9 * before > 5 * t_round          # the round: tokens/s rises
    assert b.admits(nxt) and b.refused == 0
    assert b.balance_batch(100, 100, 4096) >= 9


def test_depth_one_learns_the_trip_where_the_s_worker_waited():
    """Depth 1: T = s + max(tier, trip + R); a step the S-worker waited in teaches the trip as
    T - s - R, as a deeper pipeline's does (it stayed 0 at depth 1 before, so the rule saw the
    R-workers' rows as free behind the tier's attention)."""
    b = toy(r_speeds=(1e5,), tier_speed=1e6, depth=1)
    for i in range(4):
        b.placement.place(seq(i), 0)
    for _ in range(40):      # S-side 20 ms, the R-worker busy 4 ms, the S-worker waited 6 ms: a 2 ms trip
        b.observe(4, 0.02, [400.0, 0.0], [0.003, 0.0], [0.004, 0.0], r_wait_s=0.006)
    assert b.trip(4) == pytest.approx(0.002, rel=1e-3)


def test_a_trip_known_at_start_up_keeps_rows_off_a_slow_link():
    """The start-up trip is the rule's prior: with a 5 ms trip per step and a tier that attends in
    1 ms, a sequence goes to the tier while it has room, and none to the R-worker before any
    step has run; with no trip known the same sequences are spread by speed."""
    def run(trip):
        b = toy(r_speeds=(1e6,), tier_speed=1e6, depth=1)
        b = StepBalance(b.placement, 1, b.tier, trip=trip).attach()
        for rows in (1, 1000):
            b.s_curve.observe(rows, 0.01)
        fill(b, 20)
        return b.placement.resident
    assert run((0.005, 0.0)) == [0, 20]
    assert run(None)[0] > 0


def test_the_simulators_trip_prior_is_the_stated_link():
    """Costs.trip: every layer's latency both ways and the hop, and each row's bytes over the link
    and the device copies, from the profile's stated figures."""
    import argparse

    from fastdecode.sim.cli import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    prof = build_profile(parser.parse_args("simulate --model llama-3-8b --gpu-profile h100 --cpu-bw 350 "
                                           "--link-bw 25 --link-latency 3".split()))
    c = costs_of(prof, 2, 64)
    m, link = prof.model, prof.link
    out, back = m.to_rworker_bytes_per_token(), m.from_rworker_bytes_per_token()
    copies = (out / link.device_d2h_Bps if link.device_d2h_Bps else 0.0) + \
        (back / link.device_h2d_Bps if link.device_h2d_Bps else 0.0)
    fixed, per_row = c.trip()
    assert fixed == pytest.approx(m.num_layers * (2 * 3e-6 + link.hop_s))
    assert per_row == pytest.approx(m.num_layers * ((out + back) / 25e9 + copies))


def test_four_tensor_parallel_cards_with_sockets_never_fall_behind_the_cards_alone():
    """Llama-3-70B in fp8 over four H100s at depth 1 (the depth plan picks there): before the trip
    was learnt at depth 1, 4 sockets ran at 0.93x the cards alone."""
    import argparse

    from fastdecode.sim.cli import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    prof = build_profile(parser.parse_args("simulate --model llama-3-70b --gpu-profile h100 --cpu-bw 350 "
                                           "--cpu-eff 0.75 --link-bw 25 --link-latency 3 -tp 4 -q fp8".split()))
    trace = synthetic_trace(1500, "lognormal:1024:0.5", "uniform:128:1024", 1024, None, 1)

    def tokens_per_s(sockets):
        cfg = SimConfig(rworkers=sockets, depth=1, schedule="stabilized", max_batch=236, max_prefill_tokens=32768,
                        span_steps=True)
        run = simulate(costs_of(prof, sockets, cfg.max_batch), trace, cfg)
        return float(run.steps["tokens"].sum() / run.steps["t_s"][-1])
    card = tokens_per_s(0)
    assert tokens_per_s(4) >= 0.98 * card
