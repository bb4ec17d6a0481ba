"""`simulate --data-parallel-size D`: D identical groups (an S-worker with --rworkers R-workers
each) served from one input. The dealer hands each group lines as its queue runs low; with every
request queued at the start (or arriving in order) that interleaves the requests between the
groups, so group g is simulated on requests g, g+D, g+2D, ... The job ends with its last group:
its tokens are every group's, its wall time the longest group's."""
from __future__ import annotations

from fastdecode.sim.trace import Trace


def group_trace(trace: Trace, group: int, groups: int) -> Trace:
    """The requests group `group` of `groups` serves."""
    pick = slice(group, None, groups)
    return Trace(trace.prompt_len[pick], trace.output_len[pick], trace.max_tokens[pick], trace.arrival_s[pick])


def job_summary(first: dict, summaries: list[dict]) -> dict:
    """The job's summary from its groups' (group 0's details kept; counts summed; the wall time the
    longest group's), with each group's figures under `data_parallel_groups`."""
    wall = max(s["wall_s"] for s in summaries)
    out = dict(first)
    for key in ("requests", "requests_finished", "output_tokens", "prompt_tokens", "steps", "decode_steps"):
        out[key] = sum(s[key] for s in summaries)
    out["wall_s"] = wall
    out["output_tokens_per_s"] = round(out["output_tokens"] / wall, 3) if wall else None
    out["data_parallel_groups"] = [{"group": g, "requests": s["requests"], "output_tokens": s["output_tokens"],
                                    "wall_s": s["wall_s"], "output_tokens_per_s": s["output_tokens_per_s"]}
                                   for g, s in enumerate(summaries)]
    # the last group's end against the first's: the input's tail, however it is dealt
    out["group_end_spread_s"] = round(wall - min(s["wall_s"] for s in summaries), 4)
    return out
