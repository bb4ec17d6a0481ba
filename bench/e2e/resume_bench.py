"""What a resume costs: a job stopped at half its decode steps and rerun, against the same job
uninterrupted, measured in the same process on the same engine (no model load counted in either).

Workload: N requests (default 64) of 128 tokens each (seeded sampling, EOS ignored, short prompts),
`fastdecode generate` in local mode. Runs, in order: a warm-up job, the uninterrupted job, then
twice the job stopped (as SIGUSR1 would) after half the uninterrupted job's engine steps and the
rerun that continues the saved sequences: once with the stop saving their KV (the default,
`--save-kv-on-stop auto`: the rerun reloads it) and once without (`never`: the rerun recomputes
it), then the uninterrupted job again (the machine's load drifts between runs: the ratios are
against the mean of the two). Reported: each run's wall time, each rerun's as a ratio to the
uninterrupted job's (the target: <= 0.6 with the KV saved), its reloaded and re-prefilled
(recomputed) tokens and the steps in which it re-prefilled beside decode, and whether its text
equals the uninterrupted job's.

    python3 bench/e2e/resume_bench.py [--label NAME] [--requests 64] [--tokens 128]

Writes bench/e2e/results/resume_<label>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from inprocess import Borrowed, StepStop, drain  # noqa: E402  the tests' in-process generate helpers


def run(engine, argv: list[str], stop_at: int | None = None) -> dict:
    from fastdecode.batch.generate import run_generate
    from fastdecode.cli import build_parser
    args = build_parser().parse_args(["generate", "--quiet"] + argv)
    stop = StepStop(stop_at)
    prefill_steps = {"alone": 0, "beside_decode": 0}
    recomputed, steps, t = engine.num_recomputed_tokens, engine.step_no, time.perf_counter()

    def lend():
        stop.attach(engine)
        return Borrowed(engine)
    original_step = engine._mixed_step

    def counted_step():          # which steps re-prefill, and whether decode runs in them
        busy = [s for s in engine.scheduler.running if s.status.name == "RUNNING"]
        recomputing = engine.scheduler.step_budget() is not None
        out = original_step()
        if recomputing:
            prefill_steps["beside_decode" if busy else "alone"] += 1
        return out
    engine._mixed_step = counted_step
    try:
        _, rep, code = run_generate(lend, args, stop)
    finally:
        del engine._mixed_step
    wall = time.perf_counter() - t
    drain(engine)                               # what a stopped run left: a new process would not hold it
    return {"exit": code, "wall_s": round(wall, 2), "steps": engine.step_no - steps,
            "recomputed_tokens": engine.num_recomputed_tokens - recomputed,
            "saved_in_flight_tokens": rep["this_run"].get("saved_in_flight_tokens"),
            "saved_kv_bytes": rep["this_run"].get("saved_kv_bytes"),
            "reloaded_tokens": rep["this_run"].get("reloaded_tokens"),
            "continued_tokens": rep["this_run"].get("continued_tokens"), "recompute_steps": prefill_steps}


def texts(path: str) -> list:
    with open(path) as f:
        return [json.loads(line)["response"]["body"]["choices"] for line in f]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default=platform.node())
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    opts = ap.parse_args()
    from fastdecode import LLM
    engine = LLM("smollm2-135m", device="cpu", dtype="float32", kv_dtype="fp32", quiet=True).engine
    tmp = tempfile.mkdtemp(prefix="resume-bench-")
    inp = os.path.join(tmp, "in.jsonl")
    with open(inp, "w") as f:
        for i in range(opts.requests):
            body = {"prompt": f"Story {i}: once upon a time in a land " + "far " * (i % 7),
                    "max_tokens": opts.tokens, "temperature": 0.8, "seed": i, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")
    out = {name: os.path.join(tmp, f"{name}.jsonl") for name in ("warm", "full", "reloaded", "recomputed", "again")}
    run(engine, ["-i", inp, "-o", out["warm"]])
    full = run(engine, ["-i", inp, "-o", out["full"]])
    resumes = {}
    for name, mode in (("reloaded", "auto"), ("recomputed", "never")):
        stopped = run(engine, ["-i", inp, "-o", out[name], "--save-kv-on-stop", mode], stop_at=full["steps"] // 2)
        rerun = run(engine, ["-i", inp, "-o", out[name]])
        resumes[name] = {"save_kv_on_stop": mode,
                         "stopped": {k: stopped[k] for k in ("exit", "steps", "saved_in_flight_tokens",
                                                             "saved_kv_bytes")},
                         "rerun": rerun, "same_text_as_uninterrupted": texts(out[name]) == texts(out["full"])}
    again = run(engine, ["-i", inp, "-o", out["again"]])        # the uninterrupted job once more: the load drifts
    full_s = (full["wall_s"] + again["wall_s"]) / 2
    for r in resumes.values():
        r["rerun_over_uninterrupted"] = round(r["rerun"]["wall_s"] / full_s, 3)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    result = {
        "label": opts.label, "cpu": model, "cores": os.cpu_count(), "load_avg_at_end": os.getloadavg()[0],
        "model": "smollm2-135m (float32 S-part, fp32 KV, local mode)", "requests": opts.requests,
        "tokens": opts.tokens, "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "uninterrupted": full, "uninterrupted_again": again, **resumes,
        "saved_share_of_output": round(stopped["saved_in_flight_tokens"] / (opts.requests * opts.tokens), 3),
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"resume_{opts.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
