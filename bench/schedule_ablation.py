"""Ablation: FIFO admission vs the load-stabilizing schedule on the same request set.

Mixed prompt lengths (chat prompts with 0..N context paragraphs), generation limits drawn from
a log-normal distribution, sampling at temperature 0.7 so that sequences end early at EOS the
way real ones do. Both runs: `mpiexec -n 3 fastdecode generate --stats-json`, same max batch.
Reports throughput, the coefficient of variation of the R-part time per step, the bubble
fraction of each side, and the KV-load trace. Writes bench/results/schedule_<label>.json/.png.

    python bench/schedule_ablation.py --label devbox-2core
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAGRAPH = ("The committee met on a grey morning to review the harbour plans, the budget for the new "
             "lighthouse, and a letter from the fishermen about the winter storms. ")
QUESTIONS = ["Summarize the text in one sentence.", "What should the committee do next?",
             "List three risks mentioned or implied.", "Write a short reply to the fishermen.",
             "Explain the situation to a child.", "Give the text a title."]


def requests(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        context = PARAGRAPH * int(rng.integers(0, 12))
        max_tokens = int(np.clip(rng.lognormal(np.log(96), 0.6), 16, 384))
        body = {"messages": [{"role": "user", "content": context + QUESTIONS[i % len(QUESTIONS)]}],
                "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
        out.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return out


def run(schedule: list[str], inp: str, tmp: str, name: str, ranks: int, extra: list[str]) -> dict:
    out, stats = os.path.join(tmp, f"out_{name}.jsonl"), os.path.join(tmp, f"stats_{name}.json")
    cmd = [shutil.which("mpiexec"), "-n", str(ranks), sys.executable, "-m", "fastdecode", "generate", "-i", inp,
           "-o", out, "--quiet", "--overwrite", "--stats-json", stats] + schedule + extra
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    data = json.load(open(stats))
    steps = [s for s in data["steps"] if "r_time_max_s" in s]
    r_time = np.array([s["r_time_max_s"] for s in steps])
    kv = np.array([sum(s["kv_tokens"]) for s in steps])
    step_s = np.array([s["step_s"] for s in steps])
    s = data["summary"]
    with open(out) as f:
        done = [json.loads(line) for line in f]
    finish = [c["finish_reason"] for r in done if r["error"] is None for c in r["response"]["body"]["choices"]]
    return {"schedule": " ".join(schedule), "wall_s": s["wall_s"], "output_tokens": s["output_tokens"],
            "output_tokens_per_s": s["output_tokens_per_s"], "decode_steps": len(steps),
            "r_time_cv": round(float(r_time.std() / r_time.mean()), 4),
            "kv_tokens_cv": round(float(kv.std() / kv.mean()), 4), "kv_tokens_mean": round(float(kv.mean()), 1),
            "kv_tokens_max": int(kv.max()), "step_s_cv": round(float(step_s.std() / step_s.mean()), 4),
            "s_bubble_fraction": s["s_bubble_fraction"], "r_bubble_fraction": s["r_bubble_fraction"],
            "token_latency_p50_s": s.get("token_latency_p50_s"), "token_latency_p99_s": s.get("token_latency_p99_s"),
            "finished_by_eos": round(finish.count("stop") / max(len(finish), 1), 3),
            "trace_kv_tokens": kv.tolist(), "trace_r_time_s": [round(x, 5) for x in r_time.tolist()]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--extra", nargs="*", default=["--kv-dtype", "bf16"])
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ablation-")
    inp = os.path.join(tmp, "in.jsonl")
    with open(inp, "w") as f:
        for r in requests(args.requests, seed=0):
            f.write(json.dumps(r) + "\n")
    b = str(args.batch)
    result = {"label": args.label, "requests": args.requests, "batch": args.batch, "ranks": args.ranks, "runs": []}
    for name, sched in (("fifo", ["--schedule", "fifo", "--max-batch", b]),
                        ("stabilized", ["--schedule", "stabilized", "--max-batch", b, "--target-batch", b])):
        row = run(sched, inp, tmp, name, args.ranks, args.extra)
        result["runs"].append(row)
        print({k: v for k, v in row.items() if not k.startswith("trace")}, flush=True)
    fifo, stab = result["runs"]
    result["throughput_gain_stabilized"] = round(stab["output_tokens_per_s"] / fifo["output_tokens_per_s"] - 1, 4)
    base = os.path.join(REPO, "bench", "results", f"schedule_{args.label}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, base + ".png")
    print("stabilized vs fifo throughput:", f"{result['throughput_gain_stabilized']:+.1%}")


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run in result["runs"]:
        axes[0].plot(run["trace_kv_tokens"], label=run["schedule"].split()[1])
        axes[1].plot(np.array(run["trace_r_time_s"]) * 1e3, label=run["schedule"].split()[1])
    axes[0].set_ylabel("KV tokens held")
    axes[1].set_ylabel("R-part ms / step")
    axes[1].set_xlabel("decode step")
    axes[0].legend()
    axes[0].set_title(f"admission: fifo vs stabilized ({result['label']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
