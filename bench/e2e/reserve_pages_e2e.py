"""Page reservation end to end: `mpiexec -n 2 fastdecode generate` with the R-worker taking each
sequence's reserved pages at prefill (the default) and without (FASTDECODE_RESERVE_PAGES=0: pages
as decode fills them, by extents since they exist, one at a time with FASTDECODE_EXTENT_PAGES=1
as in the committed devbox-2core-zen5 result), runs alternating, same requests.

Per run, from --stats-json: the R-worker's kernel rate over the decode steps where the batch is
full and one layer's KV is past the caches (KV bytes attended per step / the kernel's seconds in that step; median over those steps),
and tokens/s. Between runs, the read bandwidth with the R-worker's thread count (the extension's
streaming read), so each rate has its limit from the same session. Writes
bench/e2e/results/reserve_pages_e2e_<label>.json.

    python3 bench/e2e/reserve_pages_e2e.py --label devbox-2core-zen5 [--prompts 128 --new-tokens 1024 --rounds 2]

`--knob NAME` A/Bs another environment knob the same way (NAME=1 against NAME=0, or `--values
OFF,ON`), e.g. FASTDECODE_KERNEL_TUNE (rworker.tune), or `--knob FASTDECODE_EXTENT_PAGES --values
1,8 --kv-reserve grow` (extents), into bench/e2e/results/knob_e2e_<name>_<label>.json; the keys then
say "on" where the reservation's file says "reserved".
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

from rworker import KVStore  # noqa: E402
from rworker.host.threads import pin_cpus  # noqa: E402

SMOLLM_KV_BYTES_PER_TOKEN = KVStore(30, 3, 64, "bf16", threads=1).kv_bytes_per_token()   # all 30 layers


def run(inp: str, knob: str, reserve: bool, batch: int, min_layer_mb: float, values=("0", "1"),
        kv_reserve: str = "full") -> dict:
    out, stats = tempfile.mktemp(suffix=".jsonl"), tempfile.mktemp(suffix=".json")
    cmd = [shutil.which("mpiexec"), "-n", "2", sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out,
           "--quiet", "--overwrite", "--kv-dtype", "bf16", "--max-batch", str(batch), "--stats-json", stats,
           "--kv-reserve", kv_reserve]
    env = dict(os.environ, **{knob: values[1] if reserve else values[0]})
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    data = json.load(open(stats))
    # full-batch decode steps whose KV per layer is past the caches (one layer's KV is what a call streams)
    full = [s for s in data["steps"] if "r_attend_s" in s and s["active"] == batch and s["r_attend_s"][0] > 0
            and sum(s["kv_tokens"]) * SMOLLM_KV_BYTES_PER_TOKEN / 30 > min_layer_mb * 2**20]
    rates = [sum(s["kv_tokens"]) * SMOLLM_KV_BYTES_PER_TOKEN / s["r_attend_s"][0] / 1e9 for s in full]
    return {"reserve" if knob == "FASTDECODE_RESERVE_PAGES" else "on": reserve, "full_batch_steps": len(full),
            "kernel_gbps_median": round(float(np.median(rates)), 2),
            "kernel_gbps_p90": round(float(np.percentile(rates, 90)), 2),
            "output_tokens_per_s": data["summary"]["output_tokens_per_s"],
            "r_bubble_fraction": data["summary"]["r_bubble_fraction"],
            "rworker_kernel": json.load(open(out + ".summary.json"))["rworkers"][0].get("kernel", "")}


def read_gbps(threads: int) -> float:
    mod = KVStore(1, 1, 64, threads=1)._mod
    return max(mod.read_bandwidth(512 << 20, threads, 3, pin_cpus(threads)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-layer-mb", type=float, default=48.0,
                    help="steps counted: one layer's KV past this (1.5x the dev box's 32 MB L3)")
    ap.add_argument("--rworker-threads", type=int, default=1, help="what the R-worker runs with here (for the read)")
    ap.add_argument("--knob", default="FASTDECODE_RESERVE_PAGES", help="the environment knob to A/B")
    ap.add_argument("--values", default="0,1", help="OFF,ON values of the knob")
    ap.add_argument("--kv-reserve", default="full", choices=["full", "grow"])
    args = ap.parse_args()
    values = tuple(args.values.split(","))
    if len(values) != 2:
        ap.error(f"--values must be OFF,ON, got {args.values!r}")
    word = "reserved" if args.knob == "FASTDECODE_RESERVE_PAGES" else "on"
    other = "unreserved" if word == "reserved" else "off"
    inp = tempfile.mktemp(suffix=".jsonl")
    batch_file(inp, prompts(args.prompts), args.new_tokens)
    runs, reads = [], []
    for r in range(args.rounds):
        for reserve in ((True, False) if r % 2 == 0 else (False, True)):
            reads.append(round(read_gbps(args.rworker_threads), 2))
            row = run(inp, args.knob, reserve, args.prompts, args.min_layer_mb, values, args.kv_reserve)
            row.update(round=r, read_gbps_before=reads[-1])
            runs.append(row)
            print(f"  round {r} {args.knob}={values[int(reserve)]}: kernel {row['kernel_gbps_median']:5.1f} GB/s (median of "
                  f"{row['full_batch_steps']} full steps, read {reads[-1]:.1f}), "
                  f"{row['output_tokens_per_s']:.1f} tokens/s", flush=True)
    key = "reserve" if word == "reserved" else "on"
    on = [x for x in runs if x[key]]
    off = [x for x in runs if not x[key]]
    ratio = [a["kernel_gbps_median"] / b["kernel_gbps_median"] for a, b in zip(on, off)]
    tps = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(on, off)]
    result = dict(label=args.label, knob=args.knob, values=list(values), kv_reserve=args.kv_reserve,
                  host=platform.node(), model="smollm2-135m", kv_dtype="bf16",
                  ranks=2, min_layer_mb=args.min_layer_mb, prompts=args.prompts, new_tokens=args.new_tokens, rounds=args.rounds,
                  rworker_threads=args.rworker_threads, read_best_gbps=max(reads),
                  **{f"kernel_ratio_{word}_per_round": [round(x, 3) for x in ratio],
                     f"tokens_per_s_ratio_{word}_per_round": [round(x, 3) for x in tps],
                     f"kernel_pct_of_read_{word}": round(100 * max(a["kernel_gbps_median"] for a in on) / max(reads), 1),
                     f"kernel_pct_of_read_{other}": round(100 * max(b["kernel_gbps_median"] for b in off) / max(reads), 1)},
                  runs=runs)
    name = (f"reserve_pages_e2e_{args.label}" if word == "reserved"
            else f"knob_e2e_{args.knob.lower().removeprefix('fastdecode_')}_{args.label}")
    path = os.path.join(RESULTS, name + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"kernel {word} / {other} per round: {result[f'kernel_ratio_{word}_per_round']}; tokens/s "
          f"{result[f'tokens_per_s_ratio_{word}_per_round']}; wrote {path}")


if __name__ == "__main__":
    main()
