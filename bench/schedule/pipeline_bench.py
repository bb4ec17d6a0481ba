"""Pipeline efficiency: decode step time against max(S-time, R-time), depth 1 vs 2 (vs 3).

One S-worker and one R-worker (`mpiexec -n 2`), one thread each, a fixed batch of B sequences
(prompt L, G generated tokens, EOS ignored). The prompt length is first calibrated with depth 1
so that the R-worker's time per step equals the S-worker's (balanced load: where the pipeline
matters most and is hardest); then each depth runs on the same requests. Per decode step:
    S = S-worker busy time (the decode step less the time it waited for replies; sampling and
        bookkeeping included),
    R = R-worker busy time (receiving, attending, replying; from its per-step report),
    step = the decode part of the step.
Efficiency = step / max(S, R) (ideal 1; depth 1 gives about (S + R) / max(S, R) = 2 at balance),
reported as the ratio of the means over decode steps and as the median per-step ratio; the gain
is depth-k decode tokens/s over depth 1 in the same run. Writes bench/schedule/results/pipeline_<label>.json/png.

    python3 bench/schedule/pipeline_bench.py --label devbox-2core
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
# a dense part as cheap against its KV on a one-thread CPU S-worker as a Llama-7B layer is on an
# H100 against its CPU R-workers (MHA, 4 KiB of bf16 KV per token and layer)
DEFAULT_MODEL = "random:smollm2-135m:layers=12:hidden=256:heads=16:kv_heads=16:intermediate=512:vocab=4096"


def request_file(path: str, batch: int, prompt_len: int, gen: int) -> None:
    with open(path, "w") as f:
        for i in range(batch):
            ids = [(i * 7 + j * 13) % 4000 + 10 for j in range(prompt_len)]
            body = {"prompt": ids, "max_tokens": gen, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


def run_once(args, tmp: str, prompt_len: int, depth: int) -> dict:
    inp = os.path.join(tmp, f"in_{prompt_len}.jsonl")
    if not os.path.exists(inp):
        request_file(inp, args.batch, prompt_len, args.gen)
    out = os.path.join(tmp, f"out_{prompt_len}_{depth}.jsonl")
    stats = os.path.join(tmp, f"stats_{prompt_len}_{depth}.json")
    cmd = shlex.split(args.launcher) + ["-n", "2", sys.executable, "-m", "fastdecode", "generate",
                                        "-m", args.model, "-i", inp, "-o", out, "--quiet", "--overwrite", "--kv-dtype", "bf16",
                                        "--max-batch", str(args.batch), "--max-prefill-tokens",
                                        str(args.batch * prompt_len), "--pipeline-depth", str(depth),
                                        "--s-threads", str(args.threads), "--r-threads", str(args.threads),
                                        "--stats-json", stats]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=args.timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    data = json.load(open(stats))
    # decode-only steps past the first few (warm-up: buffers grow, caches fill)
    steps = [s for s in data["steps"] if "s_time_s" in s and "r_busy_s" in s][args.warmup:]
    step = np.array([x["step_s"] - x["prefill_s"] for x in steps])
    s = step - np.array([x["r_wait_s"] for x in steps])
    r = np.array([max(x["r_busy_s"]) for x in steps])
    with open(out) as f:
        tokens = [json.loads(line)["response"]["body"]["choices"][0]["text"] for line in f]
    return {"prompt_len": prompt_len, "depth": depth, "decode_steps": len(steps),
            "s_mean_s": float(s.mean()), "r_mean_s": float(r.mean()), "step_mean_s": float(step.mean()),
            "efficiency_of_means": float(step.mean() / max(s.mean(), r.mean())),
            "efficiency_median": float(np.median(step / np.maximum(s, r))),
            "decode_tokens_per_s": float(args.batch / step.mean()),
            "r_over_s": float(r.mean() / s.mean()), "outputs": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--launcher", default="mpiexec")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256, help="first guess, calibrated to balance")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pipeline-")

    # 1. calibrate: R grows linearly with the average context L + G/2; S does not depend on it
    prompt, calibration = args.prompt_len, []
    for _ in range(3):
        row = run_once(args, tmp, prompt, 1)
        calibration.append({k: row[k] for k in ("prompt_len", "s_mean_s", "r_mean_s", "r_over_s")})
        print(f"calibrate: prompt {prompt}: S {row['s_mean_s'] * 1e3:.2f} ms, R {row['r_mean_s'] * 1e3:.2f} ms",
              flush=True)
        if abs(row["r_over_s"] - 1) < 0.1:
            break
        ctx = (prompt + args.gen / 2) / row["r_over_s"]
        prompt = max(16, int(round(ctx - args.gen / 2)))

    # 2. every depth on the balanced requests, and one S-bound and one R-bound point
    rows = []
    for p in (prompt, max(16, prompt // 4), prompt * 3):
        for depth in args.depths:
            row = run_once(args, tmp, p, depth)
            print(f"prompt {p} depth {depth}: step {row['step_mean_s'] * 1e3:.2f} ms, S {row['s_mean_s'] * 1e3:.2f}, "
                  f"R {row['r_mean_s'] * 1e3:.2f}, step/max(S,R) {row['efficiency_of_means']:.3f}", flush=True)
            rows.append(row)
    for p in {r["prompt_len"] for r in rows}:
        same = [r for r in rows if r["prompt_len"] == p]
        base = next(r for r in same if r["depth"] == 1)
        for r in same:
            r["gain_over_depth1"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            r["identical_to_depth1"] = r["outputs"] == base["outputs"]
    for r in rows:
        del r["outputs"]
    balanced = [r for r in rows if r["prompt_len"] == prompt]
    result = {"label": args.label, "model": args.model, "batch": args.batch, "gen_len": args.gen,
              "threads_per_rank": args.threads, "ranks": "mpiexec -n 2 (1 S-worker, 1 R-worker)",
              "balanced_prompt_len": prompt, "calibration": calibration, "runs": rows,
              "target": "step / max(S, R) <= 1.15 at balanced load",
              "balanced_depth2_efficiency": next(r["efficiency_of_means"] for r in balanced if r["depth"] == 2),
              "balanced_depth2_gain": next(r["gain_over_depth1"] for r in balanced if r["depth"] == 2)}
    base = os.path.join(RESULTS, f"pipeline_{args.label}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, base + ".png")
    print(f"wrote {base}.json: balanced depth 2 step/max(S,R) = {result['balanced_depth2_efficiency']:.3f}, "
          f"gain over depth 1 = {result['balanced_depth2_gain']:.2f}x")


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    prompts = sorted({r["prompt_len"] for r in result["runs"]})
    depths = sorted({r["depth"] for r in result["runs"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / (len(depths) + 1)
    for i, p in enumerate(prompts):
        same = {r["depth"]: r for r in result["runs"] if r["prompt_len"] == p}
        for j, d in enumerate(depths):
            r = same[d]
            ax.bar(i + j * width, r["step_mean_s"] * 1e3, width, color=f"C{j}", label=f"step, depth {d}" if i == 0 else None)
        r1 = same[depths[0]]
        ax.bar(i + len(depths) * width, max(r1["s_mean_s"], r1["r_mean_s"]) * 1e3, width, color="grey",
               label="max(S, R)" if i == 0 else None)
    ax.set_xticks([i + width * len(depths) / 2 for i in range(len(prompts))])
    ax.set_xticklabels([f"prompt {p}\nR/S {next(r['r_over_s'] for r in result['runs'] if r['prompt_len'] == p and r['depth'] == 1):.2f}"
                        for p in prompts])
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"pipeline: {result['label']}, B={result['batch']}, 1 thread per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
