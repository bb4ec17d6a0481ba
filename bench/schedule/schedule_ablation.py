"""Ablation: FIFO admission vs the load-stabilizing schedule on the same request set.

Mixed prompt lengths (chat prompts with 0..N context paragraphs), generation limits drawn from
a log-normal distribution, sampling at temperature 0.7 so that sequences end early at EOS the
way real ones do. Both runs: `mpiexec -n 3 fastdecode generate --stats-json`, same max batch.
Reports throughput, the coefficient of variation of the R-part time per step, the bubble
fraction of each side, and the KV-load trace. Writes bench/schedule/results/schedule_<label>.json/.png.

    python3 bench/schedule/schedule_ablation.py --label devbox-2core

A random model (`--model random:...`, prompts as token ids, no EOS) shapes the S/R balance:
`--gen fixed:N` gives every request the same length (FIFO admits and retires whole cohorts,
the paper's worst case), `--gen lognormal:MEDIAN` varied lengths. `--stop-ids K` stands in for
EOS there: each request stops at the first of K token ids of its own (stop_token_ids), which the
scheduler cannot see coming, so lengths vary below max_tokens as with a real model's EOS.
`--runs` adds `stabilized-max-tokens` (the stabilized schedule projecting every sequence to its
max_tokens, as before it learnt lengths).
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
PARAGRAPH = ("The committee met on a grey morning to review the harbour plans, the budget for the new "
             "lighthouse, and a letter from the fishermen about the winter storms. ")
QUESTIONS = ["Summarize the text in one sentence.", "What should the committee do next?",
             "List three risks mentioned or implied.", "Write a short reply to the fishermen.",
             "Explain the situation to a child.", "Give the text a title."]


def gen_lengths(spec: str, n: int, rng) -> list[int]:
    """`lognormal:MEDIAN` (sigma 0.6, clipped to [MEDIAN/6, 4*MEDIAN]) or `fixed:N`."""
    kind, _, value = spec.partition(":")
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--gen {spec!r}: expected lognormal:MEDIAN or fixed:N with a positive integer")
    size = int(value)
    if kind == "fixed":
        return [size] * n
    if kind == "lognormal":
        return [int(x) for x in np.clip(rng.lognormal(np.log(size), 0.6, n), max(1, size // 6), 4 * size)]
    raise SystemExit(f"--gen {spec!r}: expected lognormal:MEDIAN or fixed:N")


def requests(n: int, seed: int, gen: str, token_prompts: tuple[int, int] | None, stop_ids: int = 0) -> list[dict]:
    """Chat requests with 0-11 context paragraphs (a real model), or token-id prompts of
    token_prompts = (shortest, longest) tokens (a random model), each with stop_ids stop tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i, max_tokens in enumerate(gen_lengths(gen, n, rng)):
        if token_prompts is None:
            context = PARAGRAPH * int(rng.integers(0, 12))
            body = {"messages": [{"role": "user", "content": context + QUESTIONS[i % len(QUESTIONS)]}],
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
            out.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        else:
            ids = rng.integers(100, 4000, int(rng.integers(token_prompts[0], token_prompts[1] + 1))).tolist()
            body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "ignore_eos": True}
            if stop_ids:
                body["stop_token_ids"] = rng.choice(np.arange(100, 4000), stop_ids, replace=False).tolist()
            out.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return out


def run(schedule: list[str], inp: str, tmp: str, name: str, ranks: int, extra: list[str], batch: int) -> dict:
    out, stats = os.path.join(tmp, f"out_{name}.jsonl"), os.path.join(tmp, f"stats_{name}.json")
    cmd = [shutil.which("mpiexec"), "-n", str(ranks), sys.executable, "-m", "fastdecode", "generate", "-i", inp,
           "-o", out, "--quiet", "--overwrite", "--stats-json", stats] + schedule + extra
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return analyse(schedule, out, stats, batch)


def analyse(schedule: list[str], out: str, stats: str, batch: int) -> dict:
    """One run's row from its output JSONL and --stats-json file."""
    data = json.load(open(stats))
    steps = [s for s in data["steps"] if "r_time_max_s" in s]
    r_time = np.array([s["r_time_max_s"] for s in steps])
    kv = np.array([sum(s["kv_tokens"]) for s in steps])
    step_s = np.array([s["step_s"] for s in steps])
    s = data["summary"]
    with open(out) as f:
        done = [json.loads(line) for line in f]
    finish = [c["finish_reason"] for r in done if r["error"] is None for c in r["response"]["body"]["choices"]]
    n_requests = len(done)
    # the full-batch window (>= 95% of B decoding): the steady state, without the start-up ramp
    # and the drain at the end, whose length depends on how many requests the set holds
    full = [x for x in steps if x["active"] >= 0.95 * batch]
    full_kv = np.array([sum(x["kv_tokens"]) for x in full], dtype=float)
    full_r = np.array([x["r_time_max_s"] for x in full])
    full_s = np.array([x["s_time_s"] for x in full])
    full_bound = np.maximum(full_s, full_r)                  # the side that bounds each step
    window = {"full_batch_steps": len(full),
              "full_batch_tokens_per_s": round(sum(x["active"] for x in full) / sum(x["step_s"] for x in full), 3),
              "full_batch_kv_tokens_cv": round(float(full_kv.std() / full_kv.mean()), 4),
              "full_batch_r_time_cv": round(float(full_r.std() / full_r.mean()), 4),
              "full_batch_s_time_mean_s": round(float(full_s.mean()), 5),
              "full_batch_r_time_mean_s": round(float(full_r.mean()), 5),
              "full_batch_max_s_r_mean_s": round(float(full_bound.mean()), 5),
              "full_batch_step_over_max_s_r": round(float(np.mean([x["step_s"] for x in full]) / full_bound.mean()), 4),
              } if full else {"full_batch_steps": 0}
    return {"schedule": " ".join(schedule), "wall_s": s["wall_s"], "output_tokens": s["output_tokens"],
            "output_tokens_per_s": s["output_tokens_per_s"], "decode_steps": s["decode_steps"],
            # tokens after each request's first (that one comes from its prefill) per second of decode steps
            "decode_s": s["decode_s"], "decode_tokens_per_s": round((s["output_tokens"] - n_requests) / s["decode_s"], 3),
            "s_time_mean_s": round(float(np.mean([x["s_time_s"] for x in steps if "s_time_s" in x])), 5),
            "r_time_mean_s": round(float(r_time.mean()), 5),
            "r_time_cv": round(float(r_time.std() / r_time.mean()), 4),
            "kv_tokens_cv": round(float(kv.std() / kv.mean()), 4), "kv_tokens_mean": round(float(kv.mean()), 1),
            "kv_tokens_max": int(kv.max()), "step_s_cv": round(float(step_s.std() / step_s.mean()), 4),
            "s_bubble_fraction": s["s_bubble_fraction"], "r_bubble_fraction": s["r_bubble_fraction"],
            "token_latency_p50_s": s.get("token_latency_p50_s"), "token_latency_p99_s": s.get("token_latency_p99_s"),
            "finished_by_eos": round(finish.count("stop") / max(len(finish), 1), 3), **window,
            "trace_active": [x["active"] for x in steps], "trace_kv_tokens": kv.tolist(), "trace_r_time_s": [round(x, 5) for x in r_time.tolist()]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--model", default=None, help="default: the embedded smollm2-135m with chat prompts")
    ap.add_argument("--gen", default="lognormal:96", help="generation lengths: lognormal:MEDIAN or fixed:N")
    ap.add_argument("--prompt-tokens", default="16,64", help="token-id prompt lengths LO,HI (random models)")
    ap.add_argument("--stop-ids", type=int, default=0, help="random models: K stop token ids per request (EOS stand-in)")
    ap.add_argument("--runs", default="fifo,stabilized",
                    help="comma list of fifo, stabilized, stabilized-max-tokens, run in this order "
                         "(gains are against fifo, else the first)")
    ap.add_argument("--extra", nargs="*", default=["--kv-dtype", "bf16"])
    ap.add_argument("--from-stats", metavar="DIR", help="rebuild the result from an earlier run's files in DIR "
                    "(out_/stats_{fifo,stabilized}) instead of running; same other arguments")
    args = ap.parse_args()
    tmp = args.from_stats or tempfile.mkdtemp(prefix="ablation-")     # kept: out_*, stats_* for --from-stats
    inp = os.path.join(tmp, "in.jsonl")
    random_model = bool(args.model and args.model.startswith("random:"))
    token_prompts = None
    if random_model:
        lo, _, hi = args.prompt_tokens.partition(",")
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            raise SystemExit(f"--prompt-tokens {args.prompt_tokens!r}: expected LO,HI with 1 <= LO <= HI")
        token_prompts = (int(lo), int(hi))
    if not 0 <= args.stop_ids <= 1000:
        raise SystemExit(f"--stop-ids {args.stop_ids}: expected 0..1000 stop ids per request")
    if args.stop_ids and not random_model:
        raise SystemExit("--stop-ids is for random models (--model random:...); a real model has its own EOS")
    with open(inp if not args.from_stats else os.devnull, "w") as f:
        for r in requests(args.requests, 0, args.gen, token_prompts, args.stop_ids):
            f.write(json.dumps(r) + "\n")
    if args.model:
        args.extra = ["-m", args.model] + args.extra
    b = str(args.batch)
    result = {"label": args.label, "requests": args.requests, "batch": args.batch, "ranks": args.ranks,
              "model": args.model or "smollm2-135m", "gen": args.gen,
              "prompt_tokens": list(token_prompts) if token_prompts else "chat, 0-11 paragraphs",
              "stop_ids": args.stop_ids, "extra": args.extra, "runs": []}
    schedules = {"fifo": ["--schedule", "fifo", "--max-batch", b],
                 "stabilized": ["--schedule", "stabilized", "--max-batch", b, "--target-batch", b],
                 "stabilized-max-tokens": ["--schedule", "stabilized", "--max-batch", b, "--target-batch", b,
                                           "--stabilize-lengths", "max-tokens"]}
    names = args.runs.split(",")
    if not names or any(n not in schedules for n in names):
        raise SystemExit(f"--runs {args.runs!r}: expected a comma list of {', '.join(schedules)}")
    for name in names:
        sched = schedules[name]
        if args.from_stats:
            d = args.from_stats
            row = analyse(sched, os.path.join(d, f"out_{name}.jsonl"), os.path.join(d, f"stats_{name}.json"), args.batch)
        else:
            row = run(sched, inp, tmp, name, args.ranks, args.extra, args.batch)
        row["run"] = name
        result["runs"].append(row)
        print({k: v for k, v in row.items() if not k.startswith("trace")}, flush=True)
    ref = next((r for r in result["runs"] if r["run"] == "fifo"), result["runs"][0])
    for row in [r for r in result["runs"] if r is not ref]:      # gains against fifo (else the first run)
        key = row["run"].replace("-", "_")
        result[f"throughput_gain_{key}"] = round(row["output_tokens_per_s"] / ref["output_tokens_per_s"] - 1, 4)
        result[f"decode_throughput_gain_{key}"] = round(row["decode_tokens_per_s"] / ref["decode_tokens_per_s"] - 1, 4)
        if ref["full_batch_steps"] and row["full_batch_steps"]:
            result[f"full_batch_throughput_gain_{key}"] = round(
                row["full_batch_tokens_per_s"] / ref["full_batch_tokens_per_s"] - 1, 4)
    base = os.path.join(RESULTS, f"schedule_{args.label}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, base + ".png")
    for row in [r for r in result["runs"] if r is not ref]:
        print(f"{row['run']} vs {ref['run']} throughput:",
              f"{result['throughput_gain_' + row['run'].replace('-', '_')]:+.1%}")


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run in result["runs"]:
        axes[0].plot(run["trace_kv_tokens"], label=run.get("run", run["schedule"].split()[1]))
        axes[1].plot(np.array(run["trace_r_time_s"]) * 1e3, label=run.get("run", run["schedule"].split()[1]))
    axes[0].set_ylabel("KV tokens held")
    axes[1].set_ylabel("R-part ms / step")
    axes[1].set_xlabel("decode step")
    axes[0].legend()
    axes[0].set_title(f"admission: {' vs '.join(r.get('run', r['schedule'].split()[1]) for r in result['runs'])} "
                      f"({result['label']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
