"""Causal prompt attention on the CPU: the kernel module's pass (csrc/avx512/prefill.h) against torch's
fused SDPA (flash attention for CPU), bf16, one prompt at a time as the S-part runs them.

Shapes: the embedded model's (9 query heads over 3 kv heads, dims 64) and Llama-3-8B's (32 over 8,
dims 128), prompts of 128 .. 4,096 tokens. The limit measured in the same run is the machine's
vdpbf16ps rate (the microbench's 10-chain loop on one thread, times the threads): the pass's FLOPs
(2 n^2 / 2 D Hq for each of the two products, the causal half) against 64 FLOP per instruction.
Each configuration's error against float64 is recorded too (max |o - ref| over max |ref|).
Rounds interleave the two paths.

    python3 bench/kernel/prompt_attention_bench.py --label devbox-2core-zen5 [--rounds 3]

Writes bench/kernel/results/prompt_attention_<label>.json and .png (with matplotlib).
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

from rworker import isa  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
LENGTHS = (128, 512, 1024, 2048, 4096)


def inputs(n: int, hq: int, hkv: int, d: int):
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=torch.Generator().manual_seed(n + hq)).bfloat16()
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


def kernel_path(fn, q, k, v):
    n, hq, d = q.shape
    out = torch.empty(n, hq, d, dtype=torch.bfloat16)
    assert fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
              n, 0, hq, k.shape[1], d, d ** -0.5, torch.get_num_threads())
    return out


def sdpa_path(q, k, v):
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=q.shape[2] ** -0.5,
                                          enable_gqa=True)[0].transpose(0, 1)


def rel_error(o: torch.Tensor, q, k, v) -> float:
    """max |o - ref| / max |ref| against float64 (the first 256 queries: the reference is n x n)."""
    m = min(256, q.shape[0])
    qd, kd, vd = (t.double() for t in (q[:m], k[:m], v[:m]))
    rep = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    s = torch.einsum("nhd,thd->hnt", qd, kd) * q.shape[2] ** -0.5
    s = s.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hnt,thd->nhd", s.softmax(-1), vd)
    return float((o[:m].double() - ref).abs().max() / ref.abs().max())


def timed(f, reps: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = ap.parse_args()
    mod = isa.load()
    fn = getattr(mod, "prompt_attention", None)
    if fn is None or "avx512bf16" not in isa.cpu_features():
        sys.exit("this CPU or build has no AVX512-BF16 prompt pass: nothing to measure")
    threads = torch.get_num_threads()
    lengths = [int(x) for x in args.lengths.split(",")]
    peak = []
    rows: dict[tuple, dict] = {}
    for r in range(args.rounds):
        peak.append(mod.fma_rate("zmm_dpbf16", 0.3) * 64 * threads)            # GFLOP/s of the machine
        for model, (hq, hkv, d) in SHAPES.items():
            for n in lengths:
                q, k, v = inputs(n, hq, hkv, d)
                reps = max(1, int(2e9 / (n * n * hq * d)))
                row = rows.setdefault((model, n), {"model": model, "tokens": n, "heads": [hq, hkv, d],
                                                   "kernel_s": [], "sdpa_s": []})
                paths = [("kernel_s", lambda: kernel_path(fn, q, k, v)), ("sdpa_s", lambda: sdpa_path(q, k, v))]
                for key, f in (paths if r % 2 == 0 else paths[::-1]):
                    row[key].append(timed(f, reps))
                if r == 0:
                    row["kernel_rel_error"] = rel_error(kernel_path(fn, q, k, v), q, k, v)
                    row["sdpa_rel_error"] = rel_error(sdpa_path(q, k, v), q, k, v)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    peak_gflops = statistics.median(peak)
    table = []
    for (model, n), row in rows.items():
        hq, _, d = row["heads"]
        flop = 2 * 2 * (n * (n + 1) / 2) * d * hq
        ks, ss = statistics.median(row["kernel_s"]), statistics.median(row["sdpa_s"])
        table.append({**row, "kernel_ms": round(ks * 1e3, 3), "sdpa_ms": round(ss * 1e3, 3),
                      "kernel_gflops": round(flop / ks / 1e9, 1), "sdpa_gflops": round(flop / ss / 1e9, 1),
                      "kernel_over_sdpa": round(ss / ks, 2), "kernel_of_peak": round(flop / ks / 1e9 / peak_gflops, 3),
                      "sdpa_of_peak": round(flop / ss / 1e9 / peak_gflops, 3)})
        print(f"{model:13s} {n:5d}: kernel {table[-1]['kernel_ms']:8.2f} ms ({table[-1]['kernel_of_peak']:.0%} of peak), "
              f"sdpa {table[-1]['sdpa_ms']:8.2f} ms: {table[-1]['kernel_over_sdpa']}x")
    out = {**dpbf16_record(args.label, threads, args.rounds, peak), "isa": mod.ISA, "rows": table}
    write_result(out, "prompt_attention", plot)


def plot(out: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for model in SHAPES:
        rs = [r for r in out["rows"] if r["model"] == model]
        ns = [r["tokens"] for r in rs]
        ax.plot(ns, [r["kernel_of_peak"] for r in rs], "o-", label=f"{model}: kernel pass")
        ax.plot(ns, [r["sdpa_of_peak"] for r in rs], "s--", label=f"{model}: torch SDPA")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("fraction of the vdpbf16ps peak (same run)")
    ax.set_title(f"causal prompt attention, bf16, {out['threads']} threads ({out['label']})")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
