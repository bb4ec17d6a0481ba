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
interleaved, outputs checked bit-identical across layouts. `--prefetch off,scattered,on` times every
layout under each software prefetch mode (switched on the same stores; KVStore.prefetch), and
`--v-tile` picks the V layout (default: the build's). Writes
bench/kernel/results/page_runs_<label>.json and .png.

    python3 bench/kernel/page_runs_bench.py --label devbox-2core-zen5
    python3 bench/kernel/page_runs_bench.py --label NAME --v-tile 0 --prefetch off,scattered,on --layouts prompt,decode,extents
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import numpy as np

# kernel_fixtures first: it puts this checkout on sys.path
from kernel_fixtures import MODELS, RESULTS, best_time, fill_store, random_block

from rworker import KVStore
from rworker.host.threads import default_threads, pin_cpus

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
    for layout in args.layouts:
        st = KVStore(1, Hkv, D, "bf16", threads=args.threads, v_tile=args.v_tile)
        fill(st, layout, blk, B, ctx, args.extent)
        stores[layout] = st
        for mode in args.prefetch or [st.prefetch]:
            st.prefetch = mode
            outs[(layout, mode)] = st.attend(0, ids, q, np.empty((B, Hq, D), np.float32))
    modes = args.prefetch or [stores["prompt"].prefetch]
    keys = {(lay, m): lay if len(modes) == 1 else f"{lay}@{m}" for lay in args.layouts for m in modes}
    first = next(iter(outs.values()))
    identical = all(np.array_equal(first, o) for o in outs.values())
    mod = stores["prompt"]._mod
    gbps = {k: [] for k in keys.values()}
    reads = []
    out = np.empty((B, Hq, D), np.float32)
    order = list(keys)
    for r in range(args.rounds):
        reads.append(max(mod.read_bandwidth(512 << 20, args.threads, 2, pin_cpus(args.threads))))
        for layout, mode in (order if r % 2 == 0 else order[::-1]):
            stores[layout].prefetch = mode
            best, _ = best_time(lambda: stores[layout].attend(0, ids, q, out), args.reps)
            gbps[keys[(layout, mode)]].append(B * per_seq / best / 1e9)
    base = np.array(gbps[keys[("prompt", modes[0])]])
    row = dict(model=model, Hkv=Hkv, Hq=Hq, D=D, context=ctx, batch=B, kv_bytes=B * per_seq,
               page_bytes=int(stores["prompt"]._st.page_bytes), outputs_identical=identical,
               read_best_gbps=max(reads), read_gbps=reads, keys=list(keys.values()))
    for (layout, mode), k in keys.items():
        a = np.array(gbps[k])
        row[k] = dict(best_gbps=float(a.max()), pct_of_read=100 * float(a.max()) / max(reads),
                      ratio_to_prompt_median=float(np.median(a / base)), gbps=a.tolist(),
                      runs_per_head_seq0=stores[layout].page_runs(0, 0) / Hkv, prefetch=mode)
    print(f"  {model:13s} ctx {ctx:5d}: read {max(reads):5.1f}  " + "  ".join(
        f"{k} {row[k]['best_gbps']:5.1f} ({row[k]['pct_of_read']:3.0f}%, x{row[k]['ratio_to_prompt_median']:.2f})"
        for k in keys.values()) + ("" if identical else "  OUTPUTS DIFFER"), flush=True)
    del stores
    return row


def plot(rows, path_png: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(rows))
    keys = rows[0].get("keys", LAYOUTS)
    w = 0.8 / len(keys)
    for i, k in enumerate(keys):
        ax.bar(x + (i - (len(keys) - 1) / 2) * w, [r[k]["pct_of_read"] for r in rows], w, label=k)
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
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"a subset of {','.join(LAYOUTS)} (prompt required)")
    ap.add_argument("--v-tile", type=int, default=None, help="V layout of every store (default: the build's)")
    ap.add_argument("--prefetch", default=None, help="software prefetch modes to time each layout under, "
                    "e.g. off,scattered,on (default: the store's)")
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args(argv)
    args.layouts = args.layouts.split(",")
    if "prompt" not in args.layouts or any(x not in LAYOUTS for x in args.layouts):
        ap.error(f"--layouts must be a subset of {','.join(LAYOUTS)} that includes prompt, got {args.layouts}")
    args.prefetch = args.prefetch.split(",") if args.prefetch else None
    if args.prefetch and any(m not in ("off", "on", "scattered") for m in args.prefetch):
        ap.error(f"--prefetch takes modes off, on, scattered, got {args.prefetch}")
    args.threads = args.threads or default_threads()
    args.extent = args.extent or KVStore(1, 1, 64, threads=1).extent_pages
    rng = np.random.default_rng(0)
    rows = [bench_shape(args, m, int(c), rng) for m in args.models.split(",") for c in args.contexts.split(",")]
    meta = dict(label=args.label, host=platform.node(), cpu=platform.processor() or platform.machine(),
                threads=args.threads, kv_dtype="bf16", q_dtype="bf16", rounds=args.rounds, reps=args.reps,
                min_mb=args.min_mb, isa=KVStore(1, 1, 64, threads=1).isa, extent_pages=args.extent,
                v_tile=KVStore(1, 1, 64, threads=1, v_tile=args.v_tile).v_tile, prefetch_modes=args.prefetch,
                results=rows)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"page_runs_{args.label}")
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    plot(rows, base + ".png", f"decode attention by page layout, bf16, {args.threads} threads ({args.label})")
    print(f"wrote {base}.json and .png")


if __name__ == "__main__":
    main()
