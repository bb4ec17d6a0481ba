"""KV dtype end to end: `mpiexec -n 2 fastdecode generate` with bf16 KV against int8 KV, runs
alternating, same requests, on a KV-heavy workload where the R-worker bounds: by default a
random-weight model with Llama-3-8B's attention (32 query heads, 8 KV heads of 128 dims) and a
dense part small enough that one CPU core runs it in less time than the attention takes (as a GPU
runs a 7B model's), 64 sequences x 1024 generated tokens.

Per run, from --stats-json: output tokens/s; the R-worker's attention seconds per decode step
(median over the full-batch steps past --min-layer-mb of KV per layer, where the kernel streams
from memory), with the KV bytes those steps attended (per the store's own bytes per token: int8
counts its scales) as GB/s; and the S-part's seconds per step, to show which side bounds. Between
runs the read bandwidth with the R-worker's thread count (the extension's streaming read), so
each rate has its limit from the same run. Writes bench/e2e/results/kv_dtype_e2e_<label>.json.

    python3 bench/e2e/kv_dtype_e2e.py --label devbox-2core-xeon [--model M --prompts 64 --new-tokens 1024 --rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from generate_bench import batch_file, prompts  # noqa: E402
from reserve_pages_e2e import read_gbps  # noqa: E402

from fastdecode.model.source import random_config_dict, read_config, resolve_model  # noqa: E402

MODEL = "random:llama-3-8b:layers=4:hidden=512:intermediate=1024:vocab=2048"


def write_requests(path: str, model: str, n: int, new_tokens: int) -> None:
    """n requests: text prompts for a real model, 32 token ids each for a random one."""
    if not model.startswith("random:"):
        batch_file(path, prompts(n), new_tokens)
        return
    vocab = random_config_dict(model)["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, (n, 32))
    batch_file(path, ids.tolist(), new_tokens)


def run(inp: str, model: str, kv_dtype: str, batch: int, min_layer_mb: float) -> dict:
    out, stats = tempfile.mktemp(suffix=".jsonl"), tempfile.mktemp(suffix=".json")
    cmd = [shutil.which("mpiexec"), "-n", "2", sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out,
           "-m", model, "--dtype", "float32", "--quiet", "--overwrite", "--kv-dtype", kv_dtype,
           "--max-batch", str(batch), "--stats-json", stats]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    data = json.load(open(stats))
    per_token = data["summary"]["kv_bytes_per_token"]          # all layers, as the store counts them
    layers = read_config(resolve_model(model)).num_layers
    full = [s for s in data["steps"] if "r_attend_s" in s and s["active"] == batch and s["r_attend_s"][0] > 0
            and sum(s["kv_tokens"]) * per_token / layers > min_layer_mb * 2**20]
    if not full:
        raise RuntimeError(f"{kv_dtype}: no full-batch step past {min_layer_mb} MB per layer; raise --new-tokens")
    r_s = [s["r_attend_s"][0] for s in full]
    rates = [sum(s["kv_tokens"]) * per_token / t / 1e9 for s, t in zip(full, r_s)]
    summ = data["summary"]
    return {"kv_dtype": kv_dtype, "kv_bytes_per_token": per_token, "full_batch_steps": len(full),
            "r_attend_s_per_step_median": round(float(np.median(r_s)), 5),
            "step_s_median": round(float(np.median([s["step_s"] for s in full])), 5),
            "kernel_gbps_median": round(float(np.median(rates)), 2),
            "output_tokens_per_s": summ["output_tokens_per_s"], "wall_s": summ["wall_s"],
            "r_bubble_fraction": summ.get("r_bubble_fraction"), "s_bubble_fraction": summ.get("s_bubble_fraction")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-layer-mb", type=float, default=16.0,
                    help="steps counted: one layer's KV (int8's bytes) past this many MiB")
    ap.add_argument("--rworker-threads", type=int, default=1, help="what the R-worker runs with here (for the read)")
    args = ap.parse_args()
    inp = tempfile.mktemp(suffix=".jsonl")
    write_requests(inp, args.model, args.prompts, args.new_tokens)
    runs, reads = [], []
    for r in range(args.rounds):
        for kv in (("bf16", "int8") if r % 2 == 0 else ("int8", "bf16")):
            reads.append(round(read_gbps(args.rworker_threads), 2))
            row = run(inp, args.model, kv, args.prompts, args.min_layer_mb)
            row.update(round=r, read_gbps_before=reads[-1])
            runs.append(row)
            print(f"  round {r} {kv}: R {row['r_attend_s_per_step_median'] * 1e3:.1f} ms/step of "
                  f"{row['step_s_median'] * 1e3:.1f} ({row['kernel_gbps_median']:.1f} GB/s, read {reads[-1]:.1f}), "
                  f"{row['output_tokens_per_s']:.1f} tokens/s", flush=True)
    i8 = [x for x in runs if x["kv_dtype"] == "int8"]
    b16 = [x for x in runs if x["kv_dtype"] == "bf16"]
    result = dict(label=args.label, host=platform.node(), model=args.model, dtype="float32", ranks=2,
                  prompts=args.prompts, new_tokens=args.new_tokens, rounds=args.rounds, min_layer_mb=args.min_layer_mb,
                  rworker_threads=args.rworker_threads, read_best_gbps=max(reads),
                  tokens_per_s_ratio_int8_per_round=[round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
                                                     for a, b in zip(i8, b16)],
                  r_time_ratio_bf16_over_int8_per_round=[round(b["r_attend_s_per_step_median"]
                                                               / a["r_attend_s_per_step_median"], 3)
                                                         for a, b in zip(i8, b16)],
                  kernel_pct_of_read={kv: round(100 * max(x["kernel_gbps_median"] for x in runs if x["kv_dtype"] == kv)
                                                / max(reads), 1) for kv in ("int8", "bf16")},
                  runs=runs)
    path = os.path.join(RESULTS, f"kv_dtype_e2e_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"int8 / bf16 tokens/s per round: {result['tokens_per_s_ratio_int8_per_round']}; R time bf16 / int8 "
          f"{result['r_time_ratio_bf16_over_int8_per_round']}; % of read {result['kernel_pct_of_read']}; wrote {path}")


if __name__ == "__main__":
    main()
