"""Model fidelity: `fastdecode plan`'s predicted step latency and tokens/s against measured runs.

For each configuration (batch B, R-workers, prompt length, generation length): `fastdecode
profile` with that many R-workers (same launcher, same flags as the run), one fixed-batch
`fastdecode generate` (B requests of exactly that many prompt tokens, EOS ignored, admitted
together) with --stats-json, and `fastdecode plan --profile ... --json` for the same setting.
A fixed batch lives through average KV length prompt + S/2, the same average the model uses.
With `--engine-args "... --rworker-mem 48M"` (profile and run alike) a batch larger than the
memory holds runs in waves of what fits (every request has the same length): the capacity
check of the model (`plan --kv-reserve`, from the engine args, default full) is then measured too.

A shared host's speed drifts by 10-20% over minutes (other tenants), as much as the target, so
by default each configuration is profiled right before its run, as a user would profile the
machine at hand before a job; `--profile-once` profiles each R-worker count once up front.
Next to every profile and run a one-thread GEMM probe records the machine's speed, so the drift
between the two is in the result (`speed_run_over_profile`), not hidden in the error.
Writes bench/sizing/results/fidelity_<label>.json and .png.

    python3 bench/sizing/fidelity_bench.py --label devbox-2core
    python3 bench/sizing/fidelity_bench.py --label h100-box --model random:llama-3-8b:layers=8 \
        --launcher "mpirun --allow-run-as-root --oversubscribe --bind-to none" --configs 256,2,512,32 ...
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))          # profile, generate and plan run from here
RESULTS = os.path.join(HERE, "results")
LOCK = "/tmp/fastdecode-bench.lock"     # timed groups of several benches take turns on a shared machine
# (batch, R-workers (0 = local mode), prompt tokens, generated tokens)
DEFAULT_CONFIGS = [(16, 1, 64, 48), (64, 1, 64, 48), (64, 2, 256, 48), (128, 2, 32, 32),
                   (32, 1, 512, 32), (64, 0, 128, 48)]


def fastdecode_cmd(launcher: list[str], ranks: int, args: list[str]) -> list[str]:
    base = [sys.executable, "-m", "fastdecode"] + args
    return base if ranks == 1 else launcher + ["-n", str(ranks)] + base


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc


def request_file(path: str, batch: int, prompt_len: int, gen: int, vocab_lo: int = 100, span: int = 5000) -> None:
    with open(path, "w") as f:
        for i in range(batch):
            ids = [vocab_lo + (i * 7 + j * 13) % span for j in range(prompt_len)]
            body = {"prompt": ids, "max_tokens": gen, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n")


def gemm_probe(seconds: float = 1.5) -> float:
    """GFLOP/s of a fixed one-thread fp32 GEMM in a subprocess (no torch state shared with us)."""
    code = ("import time, torch\n"
            "torch.set_num_threads(1)\n"
            "a, w = torch.randn(64, 1024), torch.randn(1024, 1024)\n"
            "a @ w\n"
            "n, t = 0, time.perf_counter()\n"
            f"while time.perf_counter() - t < {seconds}:\n"
            "    a @ w\n"
            "    n += 1\n"
            "print(n * 2 * 64 * 1024 * 1024 / (time.perf_counter() - t) / 1e9)\n")
    return float(run([sys.executable, "-c", code], 120).stdout)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--launcher", default="mpiexec")
    ap.add_argument("--configs", nargs="*", default=None, help="B,R,prompt,gen (R=0: local mode)")
    ap.add_argument("--engine-args", default="--kv-dtype bf16", help="flags for profile and generate alike")
    ap.add_argument("--batches", default=None, help="profile batch grid (default: around the configs)")
    ap.add_argument("--r-bytes", default=None, help="profile --r-bytes (default: the profile's own)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--profile-once", action="store_true",
                    help="profile each R-worker count once up front instead of right before each run")
    ap.add_argument("--token-span", type=int, default=5000, help="prompt token ids lie in 100..100+span")
    ap.add_argument("--profile-args", default="", help="more flags for the profiles alone (e.g. a smaller "
                                                         "--prompt-lens grid, --link-sizes)")
    ap.add_argument("--prefill-chunk", type=int, default=8192,
                    help="--max-prefill-tokens of the runs and the profiles alike (a prompt token's cost "
                         "depends on the chunk it is prefilled in)")
    return ap.parse_args(argv)


def profile(job, result: dict, r: int, key: str) -> tuple[str, float]:
    """`fastdecode profile` with r R-workers: (its file, the GEMM probe's speed just before it)."""
    args = job.args
    path = os.path.join(job.tmp, f"profile_{key}.json")
    speed = gemm_probe()
    t = time.perf_counter()
    r_bytes = ["--r-bytes", args.r_bytes] if args.r_bytes else []
    run(fastdecode_cmd(job.launcher, r + 1, ["profile", "-m", args.model, "-o", path, "--batches", job.grid,
                                             "--max-prefill-tokens", str(args.prefill_chunk)]
                       + r_bytes + shlex.split(args.profile_args) + job.engine), args.timeout)
    print(f"profiled R={r} in {time.perf_counter() - t:.0f} s", flush=True)
    with open(path) as f:
        result["profiles"][key] = json.load(f)
    return path, speed


def generate(job, config) -> tuple[dict, list[dict], float]:
    """One fixed-batch `fastdecode generate`: (its summary, its steps, the GEMM probe's speed before it)."""
    batch, r, prompt, gen = config
    inp = os.path.join(job.tmp, f"in_{batch}_{r}_{prompt}_{gen}.jsonl")
    out, stats = inp.replace("in_", "out_"), inp.replace("in_", "stats_").replace(".jsonl", ".json")
    request_file(inp, batch, prompt, gen, span=job.args.token_span)
    run_speed = gemm_probe()
    run(fastdecode_cmd(job.launcher, r + 1, ["generate", "-m", job.args.model, "-i", inp, "-o", out, "--quiet",
                                             "--overwrite", "--max-batch", str(batch), "--max-prefill-tokens",
                                             str(job.args.prefill_chunk), "--stats-json", stats] + job.engine),
        job.args.timeout)
    with open(stats) as f:
        recorded = json.load(f)
    summary = recorded["summary"]
    if summary.get("errors") or summary["output_tokens"] != batch * gen:
        raise RuntimeError(f"{inp}: not every request was served ({summary.get('errors')} errors); see {out}")
    return summary, [s for s in recorded["steps"] if "s_time_s" in s], run_speed


def engine_flag(job, flag: str, default):
    return next((job.engine[i + 1] for i, a in enumerate(job.engine) if a == flag), default)


def predict(job, profile_path: str, config) -> dict:
    """`fastdecode plan --json` for the configuration, prefilled as the run prefills it."""
    batch, r, prompt, gen = config

    def plan_json(chunk: int) -> dict:
        return json.loads(run([sys.executable, "-m", "fastdecode", "plan", "--profile", profile_path, "--batch",
                               str(batch), "--context", str(gen), "--prompt-len", str(prompt), "--rworkers",
                               str(max(r, 1)), "--pipeline-depth", str(engine_flag(job, "--pipeline-depth", 2)),
                               "--prefill-chunk", str(chunk), "--kv-reserve", engine_flag(job, "--kv-reserve", "full"),
                               "--json"], 120).stdout)

    # whole prompts, all admitted at once: the batch, or the part of it the memory holds
    plan = plan_json(min(batch, max(1, job.args.prefill_chunk // prompt)) * prompt)
    if plan["batch_run"] < batch:
        plan = plan_json(min(plan["batch_run"], max(1, job.args.prefill_chunk // prompt)) * prompt)
    return plan


def compare(config, summary: dict, steps: list[dict], plan: dict, setting: dict) -> dict:
    """The row of one configuration: measured against predicted, and their errors. `setting`:
    pipeline_depth, kv_reserve, profile and speed_run_over_profile, recorded as they are."""
    batch, r, prompt, gen = config
    decode_steps = [s["step_s"] - s["prefill_s"] for s in steps]
    # the model's decode step is the whole batch's: steps of the ramp (part of the batch still
    # prefilling) or with a prefill beside them are left out of this mean
    full_steps = [s["step_s"] for s in steps if s["active"] == max(x["active"] for x in steps)
                  and s["prefill_s"] < 1e-3]
    # with --rworker-mem too small for the batch, the requests run in waves of what fits
    # (equal lengths, all admitted at once): a step serves one wave
    running = max(s["active"] for s in steps)
    waves = -(-batch // running)
    measured_step = summary["wall_s"] / (gen * waves)   # prefill amortized over the run, as the model does
    row = {"batch": batch, "rworkers": r, "prompt_len": prompt, "gen_len": gen,
           "pipeline_depth": setting["pipeline_depth"],
           "measured_step_latency_s": round(measured_step, 5),
           "measured_decode_step_s_mean": round(sum(decode_steps) / len(decode_steps), 5),
           "measured_tokens_per_s": round(summary["output_tokens"] / summary["wall_s"], 3),
           "predicted_step_latency_s": round(plan["step_latency_s"], 5),
           "predicted_tokens_per_s": round(plan["tokens_per_s"], 3), "predicted_bound": plan["bound"],
           "kv_reserve": setting["kv_reserve"], "measured_running_max": running,
           "predicted_batch_run": plan["batch_run"], "profile": setting["profile"],
           "speed_run_over_profile": setting["speed_run_over_profile"]}
    # the decode step alone (prefill taken out of both sides): the S/R/link part of the model
    row["predicted_decode_step_s"] = round(plan["step_latency_s"] - plan["prefill_s"], 5)
    row["decode_step_error"] = round(row["predicted_decode_step_s"] / row["measured_decode_step_s_mean"] - 1, 4)
    if full_steps:
        row["measured_full_batch_decode_step_s"] = round(sum(full_steps) / len(full_steps), 5)
        row["full_batch_decode_step_error"] = round(
            row["predicted_decode_step_s"] / row["measured_full_batch_decode_step_s"] - 1, 4)
    row["measured_prefill_s_per_token"] = round(sum(s["prefill_s"] for s in steps) / (batch * prompt), 7)
    row["predicted_prefill_s_per_token"] = round(plan["prefill_s"] * gen / (plan["batch_run"] * prompt), 7)
    row["step_latency_error"] = round(row["predicted_step_latency_s"] / measured_step - 1, 4)
    row["tokens_per_s_error"] = round(row["predicted_tokens_per_s"] / row["measured_tokens_per_s"] - 1, 4)
    return row


def summarize(result: dict) -> list[float]:
    errs = [abs(r["step_latency_error"]) for r in result["runs"]]
    result["max_abs_step_latency_error"] = max(errs)
    result["within_15_percent"] = sum(e <= 0.15 for e in errs)
    result["max_abs_decode_step_error"] = max(abs(r["decode_step_error"]) for r in result["runs"])
    full = [abs(r["full_batch_decode_step_error"]) for r in result["runs"] if "full_batch_decode_step_error" in r]
    if full:
        result["max_abs_full_batch_decode_step_error"] = max(full)
    return errs


def main(argv=None) -> None:
    args = parse_args(argv)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else DEFAULT_CONFIGS
    grid = args.batches or ",".join(str(b) for b in sorted({1, 4} | {c[0] for c in configs}
                                                            | {max(1, c[0] // 2) for c in configs}))
    job = SimpleNamespace(args=args, launcher=shlex.split(args.launcher), engine=shlex.split(args.engine_args),
                          tmp=tempfile.mkdtemp(prefix="fidelity-"), grid=grid)
    result = {"label": args.label, "model": args.model, "engine_args": args.engine_args,
              "profile_each": not args.profile_once, "runs": [], "profiles": {}}
    once = {r: profile(job, result, r, f"r{r}") for r in sorted({c[1] for c in configs})} if args.profile_once else {}
    for config in configs:
        batch, r, prompt, gen = config
        key = f"B{batch}_R{r}_p{prompt}_g{gen}"
        profile_path, profile_speed = once[r] if once else profile(job, result, r, key)
        summary, steps, run_speed = generate(job, config)
        setting = dict(pipeline_depth=int(engine_flag(job, "--pipeline-depth", 2)),
                       kv_reserve=engine_flag(job, "--kv-reserve", "full"), profile=f"r{r}" if once else key,
                       speed_run_over_profile=round(run_speed / profile_speed, 3))
        row = compare(config, summary, steps, predict(job, profile_path, config), setting)
        result["runs"].append(row)
        print(row, flush=True)
    errs = summarize(result)
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, f"fidelity_{args.label}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, base + ".png")
    print(f"wrote {base}.json; max |error| {max(errs):.1%}, {result['within_15_percent']}/{len(errs)} within 15%")


@contextlib.contextmanager
def bench_lock():
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None without matplotlib (the JSON is written anyway)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = result["runs"]
    meas = [r["measured_step_latency_s"] * 1e3 for r in runs]
    pred = [r["predicted_step_latency_s"] * 1e3 for r in runs]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(meas, pred)
    for r, m, p in zip(runs, meas, pred):
        ax.annotate(f"B{r['batch']} R{r['rworkers']} p{r['prompt_len']}", (m, p), fontsize=7)
    lo, hi = min(meas + pred) * 0.8, max(meas + pred) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.15, label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step latency (ms)")
    ax.set_ylabel("predicted step latency (ms)")
    ax.set_title(f"plan vs measured: {result['label']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
