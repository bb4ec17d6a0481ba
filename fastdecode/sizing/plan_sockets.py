"""plan --rworkers P1 P2 ...: each socket count's best, what it adds, the words where the card
alone is best, and with --requests N the job's tokens/s (its ramp and drain: sizing/job.py)."""
from __future__ import annotations

import json

from fastdecode.sizing import plan_text as text
from fastdecode.sizing.balance import Workload
from fastdecode.sizing.fidelity import fidelity, fidelity_line
from fastdecode.sizing.job import job_tokens_per_s
from fastdecode.sizing.schema import Profile

ENGINE_DEPTH = 2            # generate's default --pipeline-depth (plan.ENGINE_DEPTH)


def report_sockets(prof: Profile, rows: list[dict], knee: int, args, work: Workload, depth: int | None,
                   about: dict) -> int:
    """Print (or --json) the socket counts' table. -> the exit code."""
    if args.requests is not None:
        for r in rows:                         # the stabilized schedule's ramp and drain
            r["job_tokens_per_s"] = round(job_tokens_per_s(prof, work, r, args.requests), 1)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    fid = fidelity(prof.s_worker.device, best["bound"], prof.source == "measured")
    if args.json:
        print(json.dumps({**about, "knee_batch": knee, "fidelity": fid, "sockets": rows}, indent=1))
        return 0
    print("\n".join(text.header(prof, knee, depth or ENGINE_DEPTH, args)))
    print(text.target_line(args, depth))
    text.print_sockets(rows)
    if args.requests is not None:
        print(f"job: {args.requests:,} requests, each socket count's batch ramping up over one generation "
              f"and draining over another: " + ", ".join(f"{r['rworkers']}: {r['job_tokens_per_s']:,.0f}"
                                                          for r in rows) + " tokens/s")
    print(f"at the best ({best['rworkers']} R-workers): " + fidelity_line(fid, best["bound"]))
    return 0
