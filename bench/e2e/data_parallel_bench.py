"""Two data-parallel groups in one job against what a user would do instead, on one machine.

Systems, each on the whole batch (N chat requests, greedy, EOS ignored, new tokens from M/4 to M
by the request's number: lengths vary as real ones do, so a split by hand is uneven in work):
  one       `mpiexec -n 1 fastdecode generate`: one S-worker on every core (local mode)
  one-half  the same bound to half the cores (taskset): what one group of dp2 has, so dp2/one-half
            is the scaling of adding a second group's cores (the target on the 16-core host: >= 1.8x)
  dp2       `mpiexec -n 2 fastdecode generate --data-parallel-size 2`: two local-mode groups, each on
            its share of the cores (launch/groups.py), one input and one output
  two-jobs  the input split in two shard files by hand, two independent `fastdecode generate` jobs
            at once, each bound to half the cores (taskset): the job's end is the later one's
Interleaved rounds; whole-job wall time (start-up included) and output tokens/s, medians; the
ratios dp2/two-jobs (the target: no slower) and dp2/one; each dp2 run's group end spread (how long
after the first group ran out of work the last one did) from its report, beside group 0's mean step. Results: bench/e2e/results/data_parallel_<label>.json.

    python3 bench/e2e/data_parallel_bench.py --label devbox-2core-zen5 --requests 384 --max-tokens 128 --max-batch 32
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SYSTEMS = ("one", "one-half", "dp2", "two-jobs")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPICS = ["a lighthouse", "the sea", "a city at night", "an old map", "a robot", "rain", "a garden", "mountains"]


def new_tokens(i: int, max_tokens: int) -> int:
    """Request i's length: from max_tokens/4 to max_tokens, scattered by its number."""
    low = max(max_tokens // 4, 1)
    return low + (i * 37) % (max_tokens - low + 1)


def write_lines(path: str, indices: list[int], max_tokens: int) -> None:
    with open(path, "w") as f:
        for i in indices:
            body = {"model": "smollm2-135m", "max_tokens": new_tokens(i, max_tokens), "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} "
                                                             f"(number {i})."}]}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def mpiexec() -> str:
    return shutil.which("mpiexec") or sys.exit("data_parallel_bench: no mpiexec (pip install mpich)")


def generate(inp: str, out: str, ranks: int, extra: list[str], cpus: str | None = None) -> subprocess.Popen:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out,
           "--quiet", "--overwrite", *extra]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"data_parallel_bench: a job failed ({p.returncode}):\n{err[-3000:]}")


def tokens_of(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path) as f:
            total += sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in f)
    return total


def run_system(name: str, work: str, n: int, max_tokens: int, cores: int, extra: list[str]) -> dict:
    whole = os.path.join(work, "all.jsonl")
    start = time.perf_counter()
    if name in ("one", "one-half"):
        out = [os.path.join(work, f"{name}.out.jsonl")]
        finish([generate(whole, out[0], 1, extra, None if name == "one" else f"0-{cores // 2 - 1}")])
    elif name == "dp2":
        out = [os.path.join(work, "dp2.out.jsonl")]
        finish([generate(whole, out[0], 2, ["--data-parallel-size", "2", *extra])])
    else:
        half = cores // 2
        shards = [os.path.join(work, f"shard{k}.jsonl") for k in range(2)]
        out = [s.replace(".jsonl", ".out.jsonl") for s in shards]
        cpus = [f"0-{half - 1}", f"{half}-{cores - 1}"]
        finish([generate(shards[k], out[k], 1, extra, cpus[k]) for k in range(2)])
    wall = time.perf_counter() - start
    tokens = tokens_of(out)
    assert tokens == sum(new_tokens(i, max_tokens) for i in range(n)), (name, tokens)
    rec = {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2)}
    if name == "dp2":
        with open(out[0] + ".summary.json") as f:
            run = json.load(f)["this_run"]
        groups = run["data_parallel_groups"]
        rec["groups"] = groups
        rec["group_requests"] = [g["requests"] for g in groups]
        # how long after the first group ran out of work the last one did, in group 0's mean steps
        rec["group_end_spread_s"] = run["group_end_spread_s"]
        rec["group0_mean_step_s"] = round(groups[0]["wall_s"] / max(groups[0]["steps"], 1), 4)
    return rec


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="names the machine in the result file")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=None, help="generate's --max-batch for every job (each group's)")
    ap.add_argument("--systems", default="one,dp2,two-jobs", help="which, in order (one, one-half, dp2, two-jobs)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        sys.exit("data_parallel_bench: needs 2 cores at least")
    work = tempfile.mkdtemp(prefix="fd-dp-bench-")
    n = args.requests
    write_lines(os.path.join(work, "all.jsonl"), list(range(n)), args.max_tokens)
    for k in range(2):                        # what a user splitting by hand would do: halves
        write_lines(os.path.join(work, f"shard{k}.jsonl"), list(range(k, n, 2)), args.max_tokens)
    names = args.systems.split(",")
    if "dp2" not in names or not {"one", "one-half", "two-jobs"} & set(names) or set(names) - set(SYSTEMS):
        sys.exit(f"data_parallel_bench: --systems: dp2 and at least one peer of {', '.join(SYSTEMS)}")
    runs: dict[str, list[dict]] = {s: [] for s in names}
    for r in range(args.rounds):
        for s in (names if r % 2 == 0 else names[::-1]):
            extra = ["--max-batch", str(args.max_batch)] if args.max_batch else []
            runs[s].append(run_system(s, work, n, args.max_tokens, cores, extra))
            print(f"round {r + 1} {s}: {runs[s][-1]['wall_s']:.1f} s, {runs[s][-1]['output_tokens_per_s']:.1f} "
                  f"tokens/s", flush=True)
    med = {s: {"wall_s": statistics.median(x["wall_s"] for x in runs[s]),
               "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in runs[s])} for s in names}
    result = {"label": args.label, "cpu": cpu_name(), "cores": cores, "requests": n, "max_tokens": args.max_tokens,
              "max_batch": args.max_batch, "rounds": args.rounds, "runs": runs, "median": med}
    for peer in names:
        if peer != "dp2":
            key = "dp2_over_" + peer.replace("-", "_")
            result[key] = round(med["dp2"]["output_tokens_per_s"] / med[peer]["output_tokens_per_s"], 3)
    path = os.path.join(REPO, "bench", "e2e", "results", f"data_parallel_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k == "median" or k.startswith("dp2_over")}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
