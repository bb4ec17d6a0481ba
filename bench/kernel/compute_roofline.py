"""Compute roofline of the AVX-512 attention kernel: which of compute and memory bounds each shape.

For the shapes of kernel_bench.py, on `--threads` cores (default 1: the per-core-bound regime of
the GPU box's Xeon, and of this VM's fast spells), in interleaved rounds:

  - the multiply-add issue rates of one core (`fma_rate`: 512-bit FMA, vdpbf16ps; 256-bit FMA
    beside them, to show what a 512-bit one costs), times the
    multiply-adds per KV byte of the shape (rworker/roofline.py), give the multiply-add bound:
    the GB/s the kernel streams if it did nothing but its counted multiply-adds;
  - the kernel with its working set in the core's L2 (`--kv-kb`, default 700): its compute alone
    (everything it executes, with L2 traffic), also as a fraction of the multiply-add bound;
  - the kernel from DRAM (`--min-mb`, default 768), against the read bandwidth measured in the
    same round, against the roofline min(read, compute alone), which full overlap of compute and
    memory would reach, and against the no-overlap bound 1 / (1/read + 1/compute alone).
    The shape is compute-bound on these cores where compute alone is below the read.

    python3 bench/kernel/compute_roofline.py --label dev-1core-zen5
    python3 bench/kernel/compute_roofline.py --label h100-box-16core --threads 16

Writes bench/kernel/results/roofline_<label>.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np

# kernel_fixtures first: it puts this checkout on sys.path
from kernel_fixtures import MODELS, RESULTS, best_time, bf16_bits_to_f32, fill_store, random_block

from rworker import KVStore
from rworker import isa as isa_mod
from rworker.host.threads import pin_cpus
from rworker.kvstore import V_PAIRS
from rworker.protocol.kvformat import kv_itemsize
from rworker.roofline import compute_bound_gbps, page_ops


def layouts(args, kv_dtype: str) -> list[int | None]:
    """The V layouts to time: the store's default, and V in token pairs where it runs (bf16)."""
    out: list[int | None] = [None]
    if args.v_pairs and kv_dtype == "bf16" and KVStore(1, 1, 16, "bf16", threads=1, isa="avx512").has_v_pairs:
        out.append(V_PAIRS)
    return out


def open_filled(Hkv: int, D: int, kv_dtype: str, threads: int, v_tile, prefetch, nbytes: int, ctx: int, rng):
    """A store holding >= nbytes of KV in sequences of ctx tokens: (store, sequences, bytes)."""
    per_seq = ctx * Hkv * D * 2 * kv_itemsize(kv_dtype)
    B = max(1, -(-nbytes // per_seq))
    st = KVStore(1, Hkv, D, kv_dtype, threads=threads, isa="avx512", v_tile=v_tile, prefetch=prefetch)
    fill_store(st, random_block(rng, min(ctx, 1024), Hkv, D), B, ctx, kv_dtype)
    return st, B, B * per_seq


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kv-kb", type=int, default=700, help="working set of the compute-alone timing (one core's L2)")
    ap.add_argument("--min-mb", type=int, default=768, help="working set of the DRAM timing (past the caches)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefetch", default=None, choices=["off", "on", "scattered"],
                    help="software prefetch of every store (default: the store's, FASTDECODE_PREFETCH)")
    ap.add_argument("--no-v-pairs", dest="v_pairs", action="store_false",
                    help="skip V in token pairs (timed by default where bf16 KV has it)")
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.kv_kb < 1 or args.min_mb < 1:
        ap.error("--threads, --rounds, --kv-kb and --min-mb must be >= 1")
    return args


def time_rounds(args, mod, has_dot: bool, cache_st, Bc: int, dram_st, Bd: int, q, nbytes: tuple[int, int]) -> dict:
    """Per round: the core's multiply-add rates, the read bandwidth, and the kernel in L2 and from DRAM."""
    out = np.empty((max(Bc, Bd),) + q.shape[1:], np.float32)
    ids_c, ids_d = np.arange(Bc), np.arange(Bd)
    cpus = pin_cpus(args.threads)
    r = dict(fma=[], ymm=[], dot=[], read=[], cache=[], dram=[])
    for _ in range(args.rounds):
        r["fma"].append(mod.fma_rate("zmm", 0.2))
        r["ymm"].append(mod.fma_rate("ymm", 0.2))     # is a 512-bit FMA worth two 256-bit ones?
        r["dot"].append(mod.fma_rate("zmm_dpbf16", 0.2) if has_dot else float("nan"))
        r["read"].append(max(mod.read_bandwidth(512 << 20, args.threads, 2, cpus)))
        tc, _ = best_time(lambda: cache_st.attend(0, ids_c, q[:Bc], out[:Bc]), 5, 0.2)
        td, _ = best_time(lambda: dram_st.attend(0, ids_d, q[:Bd], out[:Bd]), 3)
        r["cache"].append(nbytes[0] / tc / 1e9)
        r["dram"].append(nbytes[1] / td / 1e9)
    return r


def measure_shape(args, mod, has_dot: bool, model: str, kv_dtype: str, v_tile, rng) -> dict:
    """One shape and V layout: its multiply-add bound, the kernel in L2 and from DRAM, and which bounds."""
    Hkv, Hq, D, _ = MODELS[model]
    g = Hq // Hkv
    bf16_dot = kv_dtype == "bf16" and has_dot        # bf16 q, as the S-worker ships it
    ops = page_ops(g, D, kv_dtype, bf16_dot=bf16_dot, v_pairs=v_tile == V_PAIRS)
    cache_st, Bc, cbytes = open_filled(Hkv, D, kv_dtype, args.threads, v_tile, args.prefetch, args.kv_kb << 10,
                                       args.context, rng)
    dram_st, Bd, dbytes = open_filled(Hkv, D, kv_dtype, args.threads, v_tile, args.prefetch, args.min_mb << 20,
                                      args.context, rng)
    q = random_block(rng, max(Bc, Bd), Hq, D)                       # bf16 bits
    if kv_dtype != "bf16":
        q = bf16_bits_to_f32(q)
    r = time_rounds(args, mod, has_dot, cache_st, Bc, dram_st, Bd, q, (cbytes, dbytes))
    pf_mode = dram_st.prefetch
    del cache_st, dram_st
    fma, dot = max(r["fma"]), (max(r["dot"]) if has_dot else max(r["fma"]))
    madd = args.threads * compute_bound_gbps(ops, fma, dot)
    read, cache, dram = max(r["read"]), max(r["cache"]), max(r["dram"])
    roof, no_overlap = min(read, cache), 1 / (1 / read + 1 / cache)
    row = dict(model=model, group=g, head_dim=D, kv_dtype=kv_dtype, prefetch=pf_mode,
               v_layout="pairs" if v_tile == V_PAIRS else "default", bf16_dot=bf16_dot,
               page_ops=ops.__dict__, fma_per_ns=fma, dot_per_ns=dot, ymm_fma_per_ns=max(r["ymm"]),
               madd_bound_gbps=madd, in_cache_gbps=cache, in_cache_pct_of_madd_bound=100 * cache / madd,
               read_gbps=read, dram_gbps=dram, dram_pct_of_read=100 * dram / read,
               roofline_gbps=roof, dram_pct_of_roofline=100 * dram / roof,
               no_overlap_gbps=no_overlap, dram_over_no_overlap=dram / no_overlap,
               bound_by="compute" if cache < read else "memory", rounds=r)
    print(f"  {model:13s} {kv_dtype} {row['v_layout']:7s}: multiply-add bound {madd:5.1f}  in cache {cache:5.1f}"
          f" ({row['in_cache_pct_of_madd_bound']:3.0f}%)  read {read:5.1f}  DRAM {dram:5.1f} GB/s"
          f" ({row['dram_pct_of_read']:3.0f}% of read, {row['dram_pct_of_roofline']:3.0f}% of the roofline,"
          f" {row['dram_over_no_overlap']:.2f}x no overlap: {row['bound_by']}-bound)", flush=True)
    return row


def main(argv=None):
    args = parse_args(argv)
    if "avx512" not in isa_mod.available_isas():
        sys.exit("compute_roofline: the AVX-512 path does not run on this CPU (its op counts are the AVX-512 kernel's)")
    mod = isa_mod.load("avx512")
    has_dot = "avx512bf16" in mod.cpu_features()          # the store then takes vdpbf16ps for bf16 q
    rng = np.random.default_rng(0)
    rows = [measure_shape(args, mod, has_dot, model, kv_dtype, v_tile, rng)
            for model in args.models.split(",") for kv_dtype in args.dtypes.split(",")
            for v_tile in layouts(args, kv_dtype)]
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"roofline_{args.label}")
    meta = dict(label=args.label, cpu=platform.processor() or platform.machine(), threads=args.threads,
                context=args.context, kv_kb=args.kv_kb, min_mb=args.min_mb, rounds=args.rounds,
                cpu_features=mod.cpu_features(), rows=rows)
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    plot(rows, base + ".png", f"{args.label}: {args.threads} thread(s), ctx {args.context}")
    print(f"wrote {base}.json, {base}.png")


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = np.arange(len(rows))
    w = 0.2
    for k, (key, name) in enumerate([("read_gbps", "read bandwidth"), ("madd_bound_gbps", "multiply-add bound"),
                                     ("in_cache_gbps", "kernel, in L2"), ("dram_gbps", "kernel, from DRAM")]):
        ax.bar(x + (k - 1.5) * w, [r[key] for r in rows], w, label=name)
    ax.set_xticks(x, [f"{r['model'].split('-')[0]} {r['kv_dtype']}{' pairs' if r['v_layout'] == 'pairs' else ''}"
                      for r in rows], fontsize=8, rotation=30, ha="right")
    ax.set_ylabel("GB/s of KV")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
