"""A finite job's tokens/s from the steady state's: what `plan --requests N` adds to its table.

A steady state holds its batch B for ever; a job of N requests ramps up to it and drains away
from it. The stabilized schedule opens slots over about one generation lifetime L (steps), so the
batch climbs from 0 to its peak (B, or N where the job is smaller) over L steps, and the last
sequences end over about another L steps as the batch falls back to 0. Each of the two edges
generates L x peak / 2 tokens at the step times of the batches it passes through (the same
prediction as the steady state's, at those batches: a small batch has the S-part's fixed cost
to itself); the rest of the job's tokens run at the peak. FIFO admission starts the batch at
once: a drain only.
"""
from __future__ import annotations

from fastdecode.sizing.balance import Workload, best_depth
from fastdecode.sizing.schema import Profile

EDGE_POINTS = 4          # batches an edge is priced at (midpoints of equal quarters of the climb)


def job_tokens_per_s(profile: Profile, work: Workload, row: dict, requests: int, ramp: bool = True) -> float:
    """Tokens/s over a job of `requests` requests at the steady state `row` (best_per_sockets' or
    a sweep row: batch_run, pipeline_depth, rworkers, tokens_per_s) holds, with its edges: the
    ramp (unless `ramp` is False: FIFO admission) and the drain."""
    if requests < 1 or row["tokens_per_s"] <= 0:
        raise ValueError("job_tokens_per_s: requests >= 1 and a running steady state")
    gen = max(work.gen_len, 1)
    peak = max(min(row["batch_run"], requests), 1)

    def step_s(batch: float) -> float:
        b = max(int(round(batch)), 1)
        if b == row["batch_run"]:
            return b / row["tokens_per_s"]
        return b / best_depth(profile, b, work, row["rworkers"], row["pipeline_depth"]).tokens_per_s

    edge_s = gen * sum(step_s(peak * (k + 0.5) / EDGE_POINTS) for k in range(EDGE_POINTS)) / EDGE_POINTS
    edges = 2 if ramp else 1
    steady_tokens = max(requests * gen - edges * gen * peak / 2, 0.0)
    return requests * gen / (edges * edge_s + steady_tokens * step_s(peak) / peak)
