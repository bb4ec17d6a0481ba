"""Decode attention over four page layouts of the same KV data, in one process.

kernel_bench fills each sequence by appending 1,024-row blocks: a prompt's layout, where a
(layer, kv head)'s pages are consecutive in memory. A decoding R-worker grows every sequence by
one token per step, so each new page (every 32 steps) comes from wherever the arena or free list
has one, and a sequence's pages end up scattered. This bench times the kernel on

  prompt      1,024-row appends (kernel_bench's layout)
  decode      32-row appends, sequences round-robin, one page at a time (extent_pages = 1, the
              layout before extents): each page lands apart from the previous one
  extents     the same appends with the store's extents (--extent pages per head taken when a
              sequence outgrows its pages, what an unreserved sequence gets under --kv-reserve grow)
  reserved    the same appends after `KVStore.reserve` of each sequence's whole length (what the
              engine sends with a prefill under --kv-reserve full): one run per (layer, head)

with the machine's read bandwidth measured every round (the extension's streaming read), rounds
interleaved, outputs checked bit-identical across layouts. Writes bench/results/page_runs_<label>.json
and .png.

    python bench/page_runs_bench.py --label devbox-2core-zen5
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import MODELS, best_time, fill_store, random_block  # noqa: E402

from rworker import KVStore  # noqa: E402
from rworker._threads import default_threads, pin_cpus  # noqa: E402

LAYOUTS = ("prompt", "decode", "extents", "reserved")


def fill(store: KVStore, layout: str, blk: np.ndarray, B: int, ctx: int, extent: int) -> None:
    store.extent_pages = 1 if layout == "decode" else extent
    if layout == "prompt":
        return fill_store(store, blk, B, ctx, "bf16")
    if layout == "reserved":
        assert store.reserve(np.arange(B), np.full(B, ctx))
    P = store.page_tokens
    for t0 in range(0, ctx, P):                 # one page of rows per sequence per call
        n = min(P, ctx - t0)
        rows = blk[np.arange(t0, t0 + n) % len(blk)]                       # [n, Hkv, D]
        store.append(0, np.repeat(np.arange(B), n), np.tile(rows, (B, 1, 1)), np.tile(rows, (B, 1, 1)))


def bench_shape(args, model: str, ctx: int, rng) -> dict:
    Hkv, Hq, D, _ = MODELS[model]
    per_seq = ctx * Hkv * D * 2 * 2
    B = max(2 * args.threads, -(-(args.min_mb << 20) // per_seq))
    blk = random_block(rng, min(ctx, 1024), Hkv, D)
    q = random_block(rng, B, Hq, D)
    ids = np.arange(B)
    stores, outs = {}, {}
    for layout in LAYOUTS:
        st = KVStore(1, Hkv, D, "bf16", threads=args.threads)
        fill(st, layout, blk, B, ctx, args.extent)
        stores[layout] = st
        outs[layout] = st.attend(0, ids, q, np.empty((B, Hq, D), np.float32))
    identical = all(np.array_equal(outs["prompt"], outs[k]) for k in LAYOUTS)
    mod = stores["prompt"]._mod
    gbps = {k: [] for k in LAYOUTS}
    reads = []
    out = np.empty((B, Hq, D), np.float32)
    for r in range(args.rounds):
        reads.append(max(mod.read_bandwidth(512 << 20, args.threads, 2, pin_cpus(args.threads))))
        for layout in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            best, _ = best_time(lambda: stores[layout].attend(0, ids, q, out), args.reps)
            gbps[layout].append(B * per_seq / best / 1e9)
    base = np.array(gbps["prompt"])
    row = dict(model=model, Hkv=Hkv, Hq=Hq, D=D, context=ctx, batch=B, kv_bytes=B * per_seq,
               page_bytes=int(stores["prompt"]._st.page_bytes), outputs_identical=identical,
               read_best_gbps=max(reads), read_gbps=reads)
    for k in LAYOUTS:
        a = np.array(gbps[k])
        row[k] = dict(best_gbps=float(a.max()), pct_of_read=100 * float(a.max()) / max(reads),
                      ratio_to_prompt_median=float(np.median(a / base)), gbps=a.tolist(),
                      runs_per_head_seq0=stores[k].page_runs(0, 0) / Hkv)
    print(f"  {model:13s} ctx {ctx:5d}: read {max(reads):5.1f}  " + "  ".join(
        f"{k} {row[k]['best_gbps']:5.1f} ({row[k]['pct_of_read']:3.0f}%, x{row[k]['ratio_to_prompt_median']:.2f})"
        for k in LAYOUTS) + ("" if identical else "  OUTPUTS DIFFER"), flush=True)
    del stores
    return row


def plot(rows, path_png: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(rows))
    for i, k in enumerate(LAYOUTS):
        ax.bar(x + (i - 1.5) * 0.2, [r[k]["pct_of_read"] for r in rows], 0.2, label=k)
    ax.axhline(90, color="gray", ls="--", lw=1)
    ax.set_xticks(x, [f"{r['model'].split('-')[0]} ctx {r['context']}" for r in rows], fontsize=8)
    ax.set_ylabel("% of read bandwidth (best, same run)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores of the CPU set")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--min-mb", type=int, default=384, help="KV megabytes per layout (past the caches)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--extent", type=int, default=None, help="pages per extent (default: the store's)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)
    args.threads = args.threads or default_threads()
    args.extent = args.extent or KVStore(1, 1, 64, threads=1).extent_pages
    rng = np.random.default_rng(0)
    rows = [bench_shape(args, m, int(c), rng) for m in args.models.split(",") for c in args.contexts.split(",")]
    meta = dict(label=args.label, host=platform.node(), cpu=platform.processor() or platform.machine(),
                threads=args.threads, kv_dtype="bf16", q_dtype="bf16", rounds=args.rounds, reps=args.reps,
                min_mb=args.min_mb, isa=KVStore(1, 1, 64, threads=1).isa, extent_pages=args.extent, results=rows)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"page_runs_{args.label}")
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    plot(rows, base + ".png", f"decode attention by page layout, bf16, {args.threads} threads ({args.label})")
    print(f"wrote {base}.json and .png")


if __name__ == "__main__":
    main()
