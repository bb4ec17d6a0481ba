"""`plan --requests N`: a finite job's tokens/s from the steady state's (fastdecode/sizing/job.py):
the ramp and the drain cost what the batches they pass through predict, a long job tends to the
steady state, a job smaller than the batch never reaches it, and FIFO admission skips the ramp."""
from __future__ import annotations

import pytest

from fastdecode.sizing import plan
from fastdecode.sizing.balance import Workload, best_depth, best_per_sockets
from fastdecode.sizing.job import job_tokens_per_s

from test_plan_balance import H100, h100_profile, plan_json, run_plan

WORK = Workload(575, 1017)


@pytest.fixture(scope="module")
def rows():
    return best_per_sockets(h100_profile(), [0, 4, 16], 575, 1017)


def test_a_long_job_runs_at_the_steady_state_and_a_short_one_below_it(rows):
    prof = h100_profile()
    for r in rows:
        long_job = job_tokens_per_s(prof, WORK, r, 10**7)
        short = job_tokens_per_s(prof, WORK, r, 2 * r["batch_run"])
        assert long_job == pytest.approx(r["tokens_per_s"], rel=2e-3)
        assert short < long_job <= r["tokens_per_s"]
        assert job_tokens_per_s(prof, WORK, r, 2 * r["batch_run"], ramp=False) > short    # FIFO: no ramp


def test_the_edges_are_priced_at_the_batches_they_pass_through(rows):
    """A job of exactly one batch: no steady part; its ramp and drain each generate L x B / 2 tokens
    over L steps priced at the quarter points of the climb."""
    prof = h100_profile()
    r = rows[-1]
    b, gen = r["batch_run"], WORK.gen_len
    quarters = [max(int(round(b * (k + 0.5) / 4)), 1) for k in range(4)]
    steps = [q / best_depth(prof, q, WORK, r["rworkers"], r["pipeline_depth"]).tokens_per_s for q in quarters]
    expected = b * gen / (2 * gen * sum(steps) / 4)
    assert job_tokens_per_s(prof, WORK, r, b) == pytest.approx(expected, rel=1e-9)
    # fewer requests than the batch: the peak is the job itself
    assert job_tokens_per_s(prof, WORK, r, 3) < job_tokens_per_s(prof, WORK, r, b)


def test_plan_requests_adds_the_jobs_column(capsys):
    doc = plan_json(capsys, *H100, "--rworkers", "0", "4", "--requests", "2000")
    for r in doc["sockets"]:
        assert 0 < r["job_tokens_per_s"] < r["tokens_per_s"]
    code, out, err = run_plan(capsys, *H100, "--rworkers", "0", "4", "--requests", "2000")
    assert code == 0 and "job: 2,000 requests" in out
    code, out, err = run_plan(capsys, *H100, "--rworkers", "4", "--requests", "2000")
    assert code == 2 and "--requests" in err and "--rworkers P1 P2" in err
    code, out, err = run_plan(capsys, *H100, "--rworkers", "0", "4", "--requests", "0")
    assert code == 2 and "--requests must be >= 1" in err
    with pytest.raises(ValueError):
        job_tokens_per_s(h100_profile(), WORK, {"batch_run": 4, "tokens_per_s": 0.0, "rworkers": 0,
                                               "pipeline_depth": 1}, 10)
    assert plan.parse([*H100, "--requests", "5"]).requests == 5
