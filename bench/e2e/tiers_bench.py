"""The S-worker's own KV tier end to end: the same requests through several layouts, compared.

Each configuration is one `generate` job (a name, a rank count, its flags) on the same request
file (random token-id prompts, greedy, EOS ignored), timed as a user waits for it (the process's
wall: start-up, prefill and decode). The outputs must be identical across configurations. The
machine's memory bandwidth is measured in the same run (a numpy copy, before and after the jobs:
this VM's swings 2x between runs), and on a GPU HF transformers `generate` runs the same model at
the largest batch that fits (--hf). Writes bench/e2e/results/tiers_<label>.json and .png.

    # dev box: the hybrid (-n 2) against all on the R-worker (-n 2 --no-device-kv) and local mode
    python3 bench/e2e/tiers_bench.py --label devbox-2core --configs local=1: \\
        remote=2:--no-device-kv hybrid=2:--device-kv
    # dev box: the S-worker's in-process tier beside an R-worker made slow (the portable kernel)
    python3 bench/e2e/tiers_bench.py --label devbox-2core-balance --slow-rworkers portable \\
        --configs local=1: hybrid=2:--device-kv "hybrid-memory-bound=2:--device-kv --no-balance"
    # GPU box: 0 and 14 R-workers (the card alone, the card + 14 cores) against HF
    python3 bench/e2e/tiers_bench.py --label h100-box --model random:llama-3-8b --device cuda \\
        --configs card=1: card+14=15: --prompt-len 4096 --prompts 256 --gen 256 --hf
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s of a large numpy copy, bytes read + written (the host's streaming limit)."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def request_file(path: str, n: int, prompt: int, gen: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            body = {"prompt": rng.integers(10, vocab - 10, prompt).tolist(), "max_tokens": gen,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def run_config(args, name: str, ranks: int, flags: list[str], inp: str, tmp: str) -> dict:
    out, stats = os.path.join(tmp, f"{name}.jsonl"), os.path.join(tmp, f"{name}.stats.json")
    cmd = [sys.executable, "-m", "fastdecode", "generate", "-m", args.model, "-i", inp, "-o", out, "--overwrite",
           "--max-batch", str(args.max_batch), "--stats-json", stats, "--device", args.device] \
        + shlex.split(args.extra) + flags
    if ranks > 1 and args.slow_rworkers:    # MPMD (MPICH's Hydra): rank 0 as asked, the R-workers on a slower kernel
        cmd = shlex.split(args.launcher) + ["-n", "1"] + cmd + [":", "-n", str(ranks - 1), "-env", "FASTDECODE_ISA",
                                                                  args.slow_rworkers] + cmd
    elif ranks > 1:
        cmd = shlex.split(args.launcher) + ["-n", str(ranks)] + cmd
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=args.timeout)
    wall = time.perf_counter() - t
    row = {"config": name, "ranks": ranks, "flags": flags, "process_wall_s": round(wall, 3)}
    if proc.returncode:
        return {**row, "error": proc.stderr[-2000:]}
    s = json.load(open(stats))["summary"]
    texts = {}
    for line in open(out):
        r = json.loads(line)
        texts[r["custom_id"]] = r["response"]["body"]["choices"][0]["text"]
    tiers_line = next((ln for ln in proc.stderr.splitlines() if "KV tiers:" in ln), "")
    return {**row, "output_tokens": s["output_tokens"], "prompt_tokens": s["prompt_tokens"],
            "generate_wall_s": s["wall_s"], "output_tokens_per_s": round(s["output_tokens"] / wall, 3),
            "generate_output_tokens_per_s": s["output_tokens_per_s"], "bound": s.get("bound"),
            "kv_tiers": s.get("kv_tiers"), "tiers_line": tiers_line.split("fastdecode: ")[-1],
            "prefill_s": (s.get("prefill") or {}).get("wall_s"), "decode_s": s.get("decode_s"), "texts": texts}


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["runs"] if "error" not in r]
    names = [r["config"] for r in rows] + [h["system"].split(" ")[0] for h in result.get("hf", []) if h]
    vals = [r["output_tokens_per_s"] for r in rows] + [h["output_tokens_per_s"] for h in result.get("hf", []) if h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, vals, color=["tab:green" if "hybrid" in n or "card" in n else "tab:gray" for n in names])
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens/s (process wall: start-up, prefill, decode)")
    ax.set_title(f"{result['label']}: {result['model']}, {result['prompts']} x {result['prompt_len']} "
                 f"+ {result['gen']} tokens; copy {result['copy_GBps_before']:.0f}/{result['copy_GBps_after']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", nargs="+", required=True, help="NAME=RANKS:FLAGS (flags space-separated)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below this")
    ap.add_argument("--extra", default="--kv-dtype bf16", help="flags every configuration gets")
    ap.add_argument("--launcher", default="mpiexec")
    ap.add_argument("--slow-rworkers", metavar="ISA", default=None,
                    help="run the R-workers (ranks 1..) on this kernel path (FASTDECODE_ISA, e.g. portable): "
                         "R-workers made deliberately slower than the S-worker's own tier (MPICH's -env)")
    ap.add_argument("--hf", action="store_true", help="HF generate on the same GPU, largest batch that fits")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each configuration, interleaved; the median counts")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="tiers-")
    inp = os.path.join(tmp, "in.jsonl")
    request_file(inp, args.prompts, args.prompt_len, args.gen, args.vocab)
    result = {"label": args.label, "model": args.model, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "gen": args.gen, "max_batch": args.max_batch, "extra": args.extra, "slow_rworkers": args.slow_rworkers,
              "copy_GBps_before": copy_bandwidth(),
              "runs": [], "hf": []}
    path = os.path.join(RESULTS, f"tiers_{args.label}")
    specs = [(name, int(rest.split(":", 1)[0]), shlex.split(rest.split(":", 1)[1]))
             for name, rest in (spec.split("=", 1) for spec in args.configs)]
    rounds: dict[str, list[dict]] = {name: [] for name, _, _ in specs}
    for r in range(args.rounds):              # interleaved: a machine's drift hits every configuration alike
        for name, ranks, flags in specs:
            row = run_config(args, name, ranks, flags, inp, tmp)
            print({k: v for k, v in row.items() if k != "texts"}, flush=True)
            rounds[name].append(row)
    for name, rows in rounds.items():        # each configuration's median round by tokens/s
        ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["output_tokens_per_s"])
        row = dict(ok[len(ok) // 2]) if ok else rows[0]
        row["rounds_output_tokens_per_s"] = [r.get("output_tokens_per_s") for r in rows]
        result["runs"].append(row)
    result["copy_GBps_after"] = copy_bandwidth()
    if args.hf:
        from e2e_bench import run_hf
        hf_args = argparse.Namespace(model=args.model, gen=args.gen, hf_device=args.device, hf_max_batch=4096)
        result["hf"].append(run_hf(hf_args, args.prompt_len))
    ok = [r for r in result["runs"] if "error" not in r]
    if ok:
        first = ok[0]["texts"]
        result["outputs_identical"] = all(r["texts"] == first for rows in rounds.values() for r in rows
                                          if "error" not in r)
        best = {r["config"]: r["output_tokens_per_s"] for r in ok}
        for r in ok:
            others = [v for k, v in best.items() if k != r["config"]]
            r["vs_best_other"] = round(r["output_tokens_per_s"] / max(others), 3) if others else None
            hf = next((h for h in result["hf"] if h), None)
            if hf:
                r["vs_hf"] = round(r["output_tokens_per_s"] / hf["output_tokens_per_s"], 3)
    for r in ok:
        r.pop("texts")
    os.makedirs(RESULTS, exist_ok=True)
    json.dump(result, open(path + ".json", "w"), indent=1)
    plot(result, path + ".png")
    print("wrote", path + ".json", "outputs identical:", result.get("outputs_identical"))


if __name__ == "__main__":
    main()
