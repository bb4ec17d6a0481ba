"""The simulator's spans (SimConfig.span_steps): the steps between two events taken in closed
form. Against stepping every step: the same tokens and steps, times exact where they lie on a
line, and job figures within 0.5-1% where the balance rule learns from the steps (its moving
averages hear a span in pieces, and a small difference in what it learnt can start a sequence a
step earlier); spans only where nothing could start; the report's per-step rows and summary count
a span's steps."""
from __future__ import annotations

import numpy as np
import pytest

from fastdecode.sim.core import SimConfig, simulate
from fastdecode.sim.costs import costs_of
from fastdecode.sim.report import step_rows, summary, timeline
from fastdecode.sim.trace import Trace, synthetic_trace
from fastdecode.sizing.hardware import GPU_PRESETS, stated_profile, stated_tier
from fastdecode.sizing.schema import MODEL_PRESETS

from test_simulate_tiers import fixed, profile


def stated(sockets_tier: bool = True):
    """One H100 with its tier, sockets at 350 GB/s (75% in the kernel), a 25 GB/s link: Llama-3-8B."""
    h100, model = GPU_PRESETS["h100"], MODEL_PRESETS["llama-3-8b"]
    tier = stated_tier(h100, model, max_batch=64, max_prefill_tokens=32768) if sockets_tier else None
    return stated_profile(h100, model, 350.0, 384.0, 25.0, 3.0, cpu_attn_eff=0.75, device_tier=tier)


def both(prof, trace: Trace, rworkers: int, **cfg):
    """(stepped, spanned) runs of one configuration."""
    runs = []
    for span in (False, True):
        c = SimConfig(**{"max_batch": 64, "rworkers": rworkers, "depth": 1, **cfg, "span_steps": span})
        runs.append(simulate(costs_of(prof, rworkers, c.max_batch), trace, c))
    return runs


def test_a_fixed_batch_is_one_span_with_the_stepped_times():
    """Eight sequences of 200 tokens on the toy tier (the first sampled at the prefill's end, 199
    decode steps): after the first step nothing can start or end until the last, so one record
    stands for the rest; the times lie on a line, so they are exact."""
    exact, fast = both(profile(rworkers=0), fixed(8, 64, 200), rworkers=0)
    assert exact.steps["t_s"].size == 199 and fast.steps["t_s"].size == 3
    assert list(fast.steps["span"]) == [1, 1, 197]         # the second step still tries the (empty) queue
    assert fast.steps["tokens"].sum() == exact.steps["tokens"].sum() == 8 * 200
    assert fast.steps["t_s"][-1] == pytest.approx(exact.steps["t_s"][-1], rel=1e-9)
    for key in ("decode_s", "s_time_s", "tier_busy_s"):
        assert fast.steps[key].sum() == pytest.approx(exact.steps[key].sum(), rel=1e-9), key
    assert fast.finish_s == pytest.approx(exact.finish_s, rel=1e-9)
    a, b = summary(exact, fixed(8, 64, 200)), summary(fast, fixed(8, 64, 200))
    for key in ("steps", "decode_steps", "output_tokens", "running_mean", "running_max", "tier_kv_share"):
        assert a[key] == pytest.approx(b[key], rel=1e-6), key


def test_nothing_spans_while_the_queue_could_still_start_a_sequence():
    """Sequences arriving one per 10 ms with room for all: every step may admit, so each is stepped."""
    trace = fixed(6, 64, 50, arrival=np.arange(6) * 0.01)
    exact, fast = both(profile(rworkers=0), trace, rworkers=0, max_batch=64)
    spans = fast.steps["span"]
    assert fast.admitted_step.tolist() == exact.admitted_step.tolist()
    # spans only after the last arrival was admitted
    last_admit = int(fast.admitted_step.max())
    assert (spans[:last_admit] == 1).all() and spans.max() > 1


@pytest.mark.parametrize("sockets,outputs", [(0, "uniform:2000:4000"), (4, "uniform:2000:4000"),
                                             (4, "uniform:128:1024")])
def test_long_jobs_match_stepping_every_step(sockets, outputs):
    """The stated H100 and its tier with 0 or 4 sockets, the balance rule on (learning from every
    step): output tokens/s, latency and the running batch within 0.5% of the stepped run, in fewer
    records where generations are long (the stabilized schedule's own pauses are stepped: whether
    it starts one at a step depends on the step)."""
    prof = stated()
    trace = synthetic_trace(60, "uniform:7000:9000", outputs, None, None, 1)
    exact, fast = both(prof, trace, sockets, depth=2 if sockets else 1, schedule="stabilized",
                       max_prefill_tokens=32768)
    a, b = summary(exact, trace), summary(fast, trace)
    assert b["output_tokens"] == a["output_tokens"] and b["requests_finished"] == a["requests_finished"] == 60
    for key in ("output_tokens_per_s", "token_latency_p50_s", "running_mean"):
        assert b[key] == pytest.approx(a[key], rel=5e-3), key
    if outputs.startswith("uniform:2000"):
        assert fast.steps["t_s"].size < 0.7 * exact.steps["t_s"].size and fast.steps["span"].max() > 20


def test_the_reports_rows_are_per_step_means_of_a_span():
    trace = fixed(8, 64, 200)
    exact, fast = both(profile(rworkers=0), trace, rworkers=0)
    rows, _ = step_rows(fast)
    assert [r["step"] for r in rows] == [1, 2, 199] and rows[2]["span"] == 197 and "span" not in rows[1]
    assert rows[2]["tokens"] == 8
    mean = exact.steps["decode_s"][2:].mean()
    assert rows[2]["step_s"] == pytest.approx(mean, abs=1e-6)          # rows round to the microsecond
    lines = timeline(fast, bins=4)
    assert sum(r["running_mean"] > 0 for r in lines) >= 1 and all(r["running_mean"] <= 8 for r in lines)


def test_the_command_line_takes_spans_on_request():
    import argparse

    from fastdecode.sim.cli import add_parser, simulate_args
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    argv = ("simulate --model llama-3-8b --gpu-profile h100 --rworkers 0 --requests 40 --prompt-len 8000 "
            "--output-len uniform:1000:2000 --pipeline-depth 1 --seed 1").split()
    exact = simulate_args(parser.parse_args(argv))
    fast = simulate_args(parser.parse_args(argv + ["--span-steps"]))
    assert fast["setting"]["span_steps"] and not exact["setting"]["span_steps"]
    assert fast["summary"]["output_tokens"] == exact["summary"]["output_tokens"]
    assert fast["summary"]["output_tokens_per_s"] == pytest.approx(exact["summary"]["output_tokens_per_s"], rel=1e-2)
    assert len(fast["steps"]) < len(exact["steps"])
