"""The S-part's projections on weights prepacked for oneDNN (fastdecode/model/packed.py) against F.linear, bf16.

Shapes: each projection of the embedded model (SmolLM2-135M: QKV 960x576, O 576x576, gate|up 3072x576,
down 576x1536, LM head 49152x576) and of Llama-3-8B (QKV 6144x4096, O 4096x4096, gate|up 28672x4096,
down 4096x14336), at 1 .. 1,024 rows (a decode step's sequences, a prefill step's tokens). The limit
measured in the same run is the machine's vdpbf16ps rate (the kernel module's microbench, one thread,
times the threads): a projection's 2 rows N K FLOPs against 64 FLOP per instruction. Each
configuration also records whether the two paths gave the same bits. Rounds interleave the paths.

    python3 bench/kernel/packed_linear_bench.py --label devbox-2core-zen5 [--rounds 3]

Writes bench/kernel/results/packed_linear_<label>.json and .png (with matplotlib).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_fixtures import dpbf16_record, write_result  # noqa: E402  (puts this checkout on sys.path)

from fastdecode.model.packed import PackedWeight  # noqa: E402
from rworker import isa  # noqa: E402

SHAPES = {"smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                           "lm_head": (49152, 576)},
          "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}}
ROWS = (1, 16, 64, 256, 1024)


def timed(f, min_s: float = 0.15) -> float:
    f()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        f()
        reps += 1
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = ap.parse_args()
    mod = isa.load()
    threads = torch.get_num_threads()
    rows_list = [int(x) for x in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    weights = {(m, p): torch.randn(*shape, generator=g).bfloat16() for m, ps in SHAPES.items()
               for p, shape in ps.items()}
    packed = {key: PackedWeight(w) for key, w in weights.items()}
    peak, table = [], {}
    for r in range(args.rounds):
        peak.append(mod.fma_rate("zmm_dpbf16", 0.3) * 64 * threads)            # GFLOP/s of the machine
        for (model, proj), w in weights.items():
            for n in rows_list:
                x = torch.randn(n, w.shape[1], generator=g).bfloat16()
                row = table.setdefault((model, proj, n), {"model": model, "projection": proj, "shape": list(w.shape),
                                                          "rows": n, "dense_s": [], "packed_s": []})
                paths = [("dense_s", lambda: F.linear(x, w)), ("packed_s", lambda: packed[model, proj].apply(x))]
                for key, f in (paths if r % 2 == 0 else paths[::-1]):
                    row[key].append(timed(f))
                if r == 0:
                    row["same_bits"] = bool(torch.equal(F.linear(x, w), packed[model, proj].apply(x)))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    peak_gflops = statistics.median(peak)
    out_rows = []
    for row in table.values():
        n_out, k = row["shape"]
        flop = 2 * row["rows"] * n_out * k
        ds, ps = statistics.median(row["dense_s"]), statistics.median(row["packed_s"])
        out_rows.append({**row, "dense_us": round(ds * 1e6, 1), "packed_us": round(ps * 1e6, 1),
                         "packed_over_dense": round(ds / ps, 3), "dense_of_peak": round(flop / ds / 1e9 / peak_gflops, 3),
                         "packed_of_peak": round(flop / ps / 1e9 / peak_gflops, 3)})
        print(f"{row['model']:13s} {row['projection']:8s} {row['rows']:5d} rows: dense {ds * 1e6:9.1f} us, packed "
              f"{ps * 1e6:9.1f} us: {ds / ps:.2f}x ({flop / ps / 1e9 / peak_gflops:.0%} of peak), same bits "
              f"{row['same_bits']}")
    out = {**dpbf16_record(args.label, threads, args.rounds, peak), "rows": out_rows}
    write_result(out, "packed_linear", plot)


def plot(out: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(11, 4), sharey=True)
    for ax, model in zip(axes, SHAPES):
        for proj in SHAPES[model]:
            rs = [r for r in out["rows"] if r["model"] == model and r["projection"] == proj]
            line, = ax.plot([r["rows"] for r in rs], [r["packed_of_peak"] for r in rs], "o-", label=f"{proj} packed")
            ax.plot([r["rows"] for r in rs], [r["dense_of_peak"] for r in rs], "s--", color=line.get_color(),
                    label=f"{proj} F.linear")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows")
        ax.set_title(model)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("fraction of the vdpbf16ps peak (same run)")
    fig.suptitle(f"bf16 projections, {out['threads']} threads ({out['label']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
