"""Every socket adds: the balance rule against memory-bound admission, through the simulator.

One H100 S-worker with its own KV tier (the `h100` preset) and P CPU sockets as R-workers (350 GB/s
read at the kernel's 75%, a 25 GB/s link with 3 us latency), P = 0 (the card alone) to 64, on two
workloads on which memory-bound admission fell behind the card alone: Llama-3-8B with 2,000 chats
(prompts 900-1,100, outputs 128-1,024, `--max-batch 4096`) and 300 prompts of 28-32k tokens
(outputs 128-512). Each point runs the
engine's admission and placement (`fastdecode simulate`) at pipeline depth 1 and 2 and keeps the
better (as a user would tune it, and as `plan` recommends), with the balance rule
(sched/balance.py, generate's default) and without it (`--no-balance`: memory alone bounds the
batch, the rule before it). Reported per point: output tokens/s over the whole job, its ratio to the
best of every smaller socket count (the target: >= 0.98) and to the card alone, the sequences
running on average, and `plan`'s best tokens/s for that socket count on the same stated hardware:
its steady state, and the job's (`plan --requests`: the batch's ramp and drain priced, sizing/job.py;
the target: the simulated job within 15% of it).

    python3 bench/sizing/balance_bench.py        # writes bench/sizing/results/balance.{json,png}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)

from fastdecode.sim.cli import add_parser, simulate_args  # noqa: E402
from fastdecode.sizing.balance import Workload, best_per_sockets  # noqa: E402
from fastdecode.sizing.job import job_tokens_per_s  # noqa: E402
from fastdecode.sizing.plan import build_profile  # noqa: E402

HARDWARE = "--gpu-profile h100 --cpu-bw 350 --cpu-eff 0.75 --link-bw 25 --link-latency 3"
WORKLOADS = {
    "llama-3-8b chat": "--model llama-3-8b --requests 2000 --prompt-len uniform:900:1100 "
                       "--output-len uniform:128:1024 --max-batch 4096",
    "llama-3-8b 32k": "--model llama-3-8b --requests 300 --prompt-len uniform:28000:32000 "
                      "--output-len uniform:128:512 --max-batch 4096",
}
SOCKETS = [0, 1, 2, 4, 8, 16, 32, 64]
PLAN_LENGTHS = {"llama-3-8b chat": (1000, 576), "llama-3-8b 32k": (30000, 320)}   # mean prompt, mean output


def simulate(workload: str, sockets: int, schedule: str, balance: bool, depth: int) -> dict:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    argv = (f"simulate {HARDWARE} {WORKLOADS[workload]} --rworkers {sockets} --schedule {schedule} "
            f"--pipeline-depth {depth} --seed 1" + ("" if balance else " --no-balance"))
    t = time.perf_counter()
    doc = simulate_args(parser.parse_args(argv.split()))
    s = doc["summary"]
    return {"workload": workload, "sockets": sockets, "schedule": schedule, "balance": balance, "depth": depth,
            "output_tokens_per_s": round(s["output_tokens_per_s"], 2), "running_mean": round(s["running_mean"], 1),
            "tier_kv_share": round(s["tier_kv_share"], 4), "bound": s["bound"],
            "sim_seconds": round(time.perf_counter() - t, 2), "command": "fastdecode " + argv}


def best_depth(workload: str, sockets: int, schedule: str, balance: bool) -> dict:
    """The better of depth 1 and 2; the other's tokens/s kept beside it."""
    runs = [simulate(workload, sockets, schedule, balance, d) for d in (1, 2)]
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return {**best, "other_depth_tokens_per_s": min(r["output_tokens_per_s"] for r in runs)}


def plan_rows(workload: str, sockets: list[int]) -> dict[int, tuple[float, float]]:
    """plan's best tokens/s per socket count (sizing/balance.py), the workload's mean lengths:
    (its steady state, and the job's with its ramp and drain for the workload's request count,
    as `plan --requests` gives it: sizing/job.py; FIFO's job has no ramp)."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(f"simulate {HARDWARE} {WORKLOADS[workload]}".split())
    prompt, gen = PLAN_LENGTHS[workload]
    prof = build_profile(args)
    rows = best_per_sockets(prof, sockets, gen, prompt)
    work = Workload(gen, prompt)
    return {r["rworkers"]: (round(r["tokens_per_s"], 2),
                            {ramp: round(job_tokens_per_s(prof, work, r, args.requests, ramp), 2)
                             for ramp in (True, False)}) for r in rows}


def add_plan(rows: list[dict], plans: dict) -> None:
    """Each balance row's plan figures and the simulated job's ratio to them."""
    for r in rows:
        if not r["balance"] or r["sockets"] not in plans.get(r["workload"], {}):
            continue
        steady, job = plans[r["workload"]][r["sockets"]]
        r["plan_tokens_per_s"], r["plan_job_tokens_per_s"] = steady, job[r["schedule"] == "stabilized"]
        r["sim_over_plan"] = round(r["output_tokens_per_s"] / steady, 3)
        r["sim_over_plan_job"] = round(r["output_tokens_per_s"] / r["plan_job_tokens_per_s"], 3)


def ratios(rows: list[dict]) -> None:
    """x_best_smaller: tokens/s over the best of every smaller socket count; x_card: over P = 0."""
    for key in {(r["workload"], r["schedule"], r["balance"]) for r in rows}:
        series = sorted((r for r in rows if (r["workload"], r["schedule"], r["balance"]) == key),
                        key=lambda r: r["sockets"])
        card = series[0]["output_tokens_per_s"]
        best = 0.0
        for r in series:
            r["x_card"] = round(r["output_tokens_per_s"] / card, 3)
            r["x_best_smaller"] = round(r["output_tokens_per_s"] / best, 3) if best else None
            best = max(best, r["output_tokens_per_s"])


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(6 * len(WORKLOADS), 4))
    for ax, workload in zip(axes, WORKLOADS):
        for balance, style in ((True, "o-"), (False, "x--")):
            for schedule in ("stabilized", "fifo"):
                pts = sorted((r["sockets"], r["output_tokens_per_s"]) for r in rows if r["workload"] == workload
                             and r["balance"] == balance and r["schedule"] == schedule)
                if pts:
                    ax.plot([max(p, 0.5) for p, _ in pts], [t for _, t in pts], style,
                            label=f"{schedule}, {'balance' if balance else 'memory-bound (--no-balance)'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CPU sockets (0 plotted at 0.5: the card alone)")
        ax.set_ylabel("output tokens/s")
        plan = sorted((r["sockets"], r["plan_tokens_per_s"]) for r in rows if r["workload"] == workload
                      and r["balance"] and r["schedule"] == "stabilized" and r.get("plan_tokens_per_s"))
        if plan:
            ax.plot([max(p, 0.5) for p, _ in plan], [t for _, t in plan], ":", color="gray", label="plan (steady state)")
        job = sorted((r["sockets"], r["plan_job_tokens_per_s"]) for r in rows if r["workload"] == workload
                     and r["balance"] and r["schedule"] == "stabilized" and r.get("plan_job_tokens_per_s"))
        if job:
            ax.plot([max(p, 0.5) for p, _ in job], [t for _, t in job], "-.", color="gray",
                    label="plan --requests (the job: ramp and drain)")
        ax.set_title(f"{workload}: one H100 + P sockets (simulated)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sockets", type=int, nargs="+", default=SOCKETS)
    ap.add_argument("--schedules", nargs="+", default=["stabilized", "fifo"])
    ap.add_argument("--only", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--label", default="balance")
    ap.add_argument("--plan-only", action="store_true",
                    help="recompute plan's columns of an existing result (no simulation) and its plot")
    args = ap.parse_args()
    out = os.path.join(RESULTS, f"{args.label}.json")
    plans = {w: plan_rows(w, args.sockets) for w in args.only}
    if args.plan_only:
        with open(out) as f:
            rows = json.load(f)["rows"]
    else:
        rows = []
        for workload in args.only:
            for schedule in args.schedules:
                for balance in (True, False):
                    for p in args.sockets:
                        rows.append(best_depth(workload, p, schedule, balance))
                        print(json.dumps(rows[-1]), flush=True)
    add_plan(rows, plans)
    ratios(rows)
    os.makedirs(RESULTS, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"hardware": HARDWARE, "workloads": WORKLOADS, "rows": rows}, f, indent=1)
    try:
        plot(rows, out.replace(".json", ".png"))
    except ImportError:
        print("no matplotlib: plot skipped", file=sys.stderr)
    worst = min((r["x_best_smaller"] for r in rows if r["balance"] and r["x_best_smaller"]), default=None)
    print(f"wrote {out}; with the balance rule the worst tokens/s against the best smaller socket count: {worst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
