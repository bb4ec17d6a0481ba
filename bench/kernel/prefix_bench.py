"""Shared prefixes in the kernel: one decode-attention call over sequences that share a prefix
(forked from one donor: `KVStore.fork`) against the same sequences each holding its own copy.

Per (shape, kv dtype, group size): G sequences = a shared prefix of --prefix tokens + a private
tail of --private tokens each (the decode token included), as many groups as make the unshared
store >= --min-mb (so it streams from DRAM), bf16 queries. Both stores are attended in interleaved
rounds (A/B, B/A, ...), the read bandwidth of the same thread count measured in each round.
Reported: bytes each store holds (bytes_committed: shared pages once), median seconds per call,
the ratio unshared / shared of each (per round, median), the shared call's rate as logical
GB/s (the bytes the unshared store streams for the same outputs, per second) against the read
bandwidth, and the largest output difference (within fp32 rounding: the shared call merges the
prefix's partial with the tail's, the unshared one runs the chunks in another order).

    python3 bench/kernel/prefix_bench.py --label devbox-2core            # ~2-3 minutes
Writes bench/kernel/results/prefix_<label>.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from kernel_fixtures import MODELS, RESULTS, f32_to_bf16_bits

from rworker import KVStore
from rworker.host.threads import pin_cpus

GROUPS = (8, 64, 256)


def read_gbps(threads: int) -> float:
    """The read bandwidth of `threads` threads (the extension's streaming loop), GB/s."""
    mod = KVStore(1, 1, 64, threads=1)._mod
    return max(mod.read_bandwidth(512 << 20, threads, 2, pin_cpus(threads)))


def build(Hkv: int, D: int, dt: str, groups: int, G: int, prefix: int, private: int, shared: bool, threads: int,
          rng_seed: int = 0) -> tuple[KVStore, np.ndarray]:
    """A one-layer store of `groups` groups of G sequences; ids in group order."""
    rng = np.random.default_rng(rng_seed)
    st = KVStore(1, Hkv, D, dt, threads=threads)
    ids = []
    for grp in range(groups):
        pre = rng.standard_normal((prefix, Hkv, D), dtype=np.float32)
        donor = grp * G
        for m in range(G):
            sid = donor + m
            if shared and m > 0:
                st.fork(donor, sid, prefix)
            else:
                st.append(0, np.full(prefix, sid, np.int64), pre, pre)
            tail = rng.standard_normal((private, Hkv, D), dtype=np.float32)
            ids.append(sid)
            st.append(0, np.full(private, sid, np.int64), tail, tail)
    return st, np.array(ids, np.int64)


def point(model: str, dt: str, G: int, args) -> dict:
    Hkv, Hq, D, _ = MODELS[model]
    tok_bytes = KVStore(1, Hkv, D, dt).kv_bytes_per_token()
    per_group = G * (args.prefix + args.private) * tok_bytes
    groups = max(1, int(np.ceil(args.min_mb * 2**20 / per_group)))
    a, ids = build(Hkv, D, dt, groups, G, args.prefix, args.private, True, args.threads)
    b, _ = build(Hkv, D, dt, groups, G, args.prefix, args.private, False, args.threads)
    q = f32_to_bf16_bits(np.random.default_rng(1).standard_normal((len(ids), Hq, D), dtype=np.float32))
    oa, ob = a.attend(0, ids, q), b.attend(0, ids, q)
    ts = {"shared": [], "unshared": []}
    reads = []
    for r in range(args.rounds):
        order = (("shared", a), ("unshared", b)) if r % 2 == 0 else (("unshared", b), ("shared", a))
        for name, st in order:
            t = time.perf_counter()
            st.attend(0, ids, q)
            ts[name].append(time.perf_counter() - t)
        reads.append(read_gbps(args.threads))
    ratio = [u / s for u, s in zip(ts["unshared"], ts["shared"])]
    read = float(np.median(reads))
    t_sh, t_un = float(np.median(ts["shared"])), float(np.median(ts["unshared"]))
    row = dict(model=model, kv_dtype=dt, group=G, groups=groups, sequences=len(ids),
               bytes_shared=a.bytes_committed(), bytes_unshared=b.bytes_committed(),
               bytes_ratio=round(b.bytes_committed() / a.bytes_committed(), 3),
               seconds_shared=round(t_sh, 6), seconds_unshared=round(t_un, 6),
               time_ratio=round(float(np.median(ratio)), 3), rounds_shared_won=int(sum(x > 1 for x in ratio)),
               read_gbps=round(read, 2), unshared_pct_of_read=round(100 * b.bytes_committed() / t_un / 1e9 / read, 1),
               shared_logical_gbps=round(b.bytes_committed() / t_sh / 1e9, 2),
               max_abs_diff=float(np.abs(oa - ob).max()))
    print(f"  {model:13s} {dt:5s} G {G:4d} x {groups:3d}: bytes {row['bytes_ratio']:6.2f}x less, time "
          f"{row['time_ratio']:5.2f}x less ({row['rounds_shared_won']}/{args.rounds}), unshared "
          f"{row['unshared_pct_of_read']:.0f}% of read {read:.1f} GB/s, shared {row['shared_logical_gbps']:.1f} "
          f"logical GB/s, max diff {row['max_abs_diff']:.2e}", flush=True)
    return row


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, title in (("bytes_ratio", axes[0], "KV bytes, unshared / shared"),
                           ("time_ratio", axes[1], "kernel time, unshared / shared")):
        for (model, dt) in sorted({(r["model"], r["kv_dtype"]) for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["model"] == model and r["kv_dtype"] == dt]
            ax.plot([r["group"] for r in rows], [r[key] for r in rows], "o-", label=f"{model} {dt}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences per shared prefix")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"shared prefix {result['prefix']} + private {result['private']} tokens, {result['threads']} "
                 f"threads, {result['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="bf16,int8")
    ap.add_argument("--groups", default=",".join(map(str, GROUPS)))
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--private", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-mb", type=float, default=512)
    args = ap.parse_args()
    rows = [point(m, dt, int(g), args) for m in args.models.split(",") for dt in args.dtypes.split(",")
            for g in args.groups.split(",")]
    result = dict(label=args.label, host=platform.node(), cpu=platform.processor(), threads=args.threads,
                  prefix=args.prefix, private=args.private, rounds=args.rounds, min_mb=args.min_mb, rows=rows)
    path = os.path.join(RESULTS, f"prefix_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, path[:-5] + ".png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
