"""Kernel A/B: an earlier build of one ISA module against the current one, in the same process.

Run-to-run drift on a shared host (10-25% here) is larger than most kernel changes, so comparing
two kernel_bench runs says little. This bench loads both builds into one process, fills one store
per build with the same data, checks that both give bit-identical outputs, and times them in
alternating order over several rounds (the read bandwidth is measured every round too). The
figure per shape is the median of the per-round ratio new / old; `new_wins` counts the rounds
where the new build was faster.

    git worktree add /tmp/fd-old REV && (cd /tmp/fd-old && python3 setup.py build_ext --inplace)
    python3 setup.py build_ext --inplace
    python3 bench/kernel/kernel_ab.py --old /tmp/fd-old --isa avx2 --label dev-2core-noavx512-v7

Or two V layouts of the current build (a store option, simd.h V_TILE_ALT), no second checkout:

    python3 bench/kernel/kernel_ab.py --v-tiles 0,32 --isa avx512 --label h100-box-avx512-vtile32

and/or with and without the software prefetch (FASTDECODE_PREFETCH, read by each store):

    python3 bench/kernel/kernel_ab.py --v-tiles 0,32 --prefetch 0,1 --isa avx512 --label NAME

and/or with the AMX tiles on one side (csrc/avx512/amx.h; bf16 KV with bf16 queries, items of 2
query rows or more: the scores, and with V in token pairs PV as well; an AMX CPU for "on", any
AVX512-BF16 one for "emulate", which only checks):

    python3 bench/kernel/kernel_ab.py --amx off,on --isa avx512 --dtypes bf16 --label NAME
    python3 bench/kernel/kernel_ab.py --v-tiles=-2,-2 --amx off,on --isa avx512 --dtypes bf16 --label NAME

`--v-tiles 0,-2` puts token-major V against V in token pairs (bf16 probabilities, other bits
by design: the rows then carry `max_abs_diff` between the two outputs instead of a bitwise match).
`--threads 1` is this VM's stand-in for the per-core-bound regime (the GPU box's Xeon, or the VM's
fast spells): one core streams ~30 GB/s, less than the ~35 GB/s the VM's DRAM gives two.

With --kv-kb (e.g. 700 and --threads 1: one core's L2) the working set stays in the caches and
the A/B times the kernel's compute alone: the regime of a host whose cores, not its DRAM, bound
attention, as on the GPU box's Xeon. Its "% of read" can pass 100 and says nothing there.

Writes bench/kernel/results/kernel_ab_<label>.json and .png.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import subprocess
import sys

import numpy as np

# kernel_fixtures first: it puts this checkout on sys.path
from kernel_fixtures import MODELS, REPO, RESULTS, best_time, bf16_bits_to_f32, fill_store, random_block

from rworker import KVStore
from rworker import isa as isa_mod
from rworker.host.threads import default_threads, pin_cpus
from rworker.protocol.kvformat import kv_itemsize


def load_old(build_dir: str, isa: str):
    """The module rworker/_kernels_<isa>*.so of another checkout, under a private name."""
    paths = glob.glob(os.path.join(build_dir, "rworker", f"_kernels_{isa}*.so"))
    if not paths:
        sys.exit(f"kernel_ab: no rworker/_kernels_{isa}*.so under {build_dir} (build it there first)")
    spec = importlib.util.spec_from_file_location(f"fd_old_build._kernels_{isa}", paths[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def git_rev(path: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def ab_shape(args, old_mod, model: str, ctx: int, kv_dtype: str, rng) -> dict:
    Hkv, Hq, D, _ = MODELS[model]
    isz = kv_itemsize(kv_dtype)
    want = args.kv_kb * 2**10 if args.kv_kb else args.min_mb * 2**20
    B = max(1 if args.kv_kb else 2 * args.threads, -(-want // (ctx * Hkv * D * 2 * isz)))
    blk = random_block(rng, min(ctx, 1024), Hkv, D)                     # [rows, Hkv, D] bf16 bits
    q = random_block(rng, B, Hq, D)                                     # [B, Hq, D] bf16 bits
    if kv_dtype != "bf16":
        q = bf16_bits_to_f32(q)                                         # fp32 KV runs get fp32 q
    ids = np.arange(B)
    nbytes = B * ctx * Hkv * D * 2 * isz

    stores = {}
    saved_prefetch = os.environ.get("FASTDECODE_PREFETCH")
    for name in ("old", "new"):
        v_tile = args.v_tiles[name == "new"] if args.v_tiles else None
        if args.prefetch:                          # each store reads FASTDECODE_PREFETCH when built
            os.environ["FASTDECODE_PREFETCH"] = str(args.prefetch[name == "new"])
        st = KVStore(1, Hkv, D, kv_dtype, threads=args.threads, isa=args.isa, v_tile=v_tile,
                     amx=args.amx[name == "new"] if args.amx else None)
        if name == "old" and not args.same_build:  # same wrapper, the other build's store underneath
            st._st = old_mod.Store(1, Hkv, D, kv_dtype, st.scale, 0, args.threads, pin_cpus(args.threads), 50)
        fill_store(st, blk, B, ctx, kv_dtype)
        stores[name] = st
    if saved_prefetch is None:
        os.environ.pop("FASTDECODE_PREFETCH", None)
    else:
        os.environ["FASTDECODE_PREFETCH"] = saved_prefetch
    out_old, out_new = np.empty((B, Hq, D), np.float32), np.empty((B, Hq, D), np.float32)
    stores["old"].attend(0, ids, q, out_old)
    stores["new"].attend(0, ids, q, out_new)
    identical = bool(np.array_equal(out_old, out_new))
    max_abs_diff = float(np.abs(out_old - out_new).max())     # a layout with other bits (V pairs): how far

    gbps = {"old": [], "new": []}
    reads = []
    for r in range(args.rounds):
        reads.append(max(old_mod.read_bandwidth(512 << 20, args.threads, 2, pin_cpus(args.threads))))
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            best, _ = best_time(lambda: stores[name].attend(0, ids, q, out_new), args.reps, 0.2 if args.kv_kb else 0.0)
            gbps[name].append(nbytes / best / 1e9)
    a, b = np.array(gbps["old"]), np.array(gbps["new"])
    row = dict(model=model, Hkv=Hkv, Hq=Hq, D=D, context=ctx, batch=B, kv_dtype=kv_dtype, kv_bytes=nbytes,
               outputs_identical=identical, max_abs_diff=max_abs_diff, rounds=args.rounds,
               read_best_gbps=max(reads), read_median_gbps=float(np.median(reads)),
               old_best_gbps=float(a.max()), new_best_gbps=float(b.max()),
               old_median_gbps=float(np.median(a)), new_median_gbps=float(np.median(b)),
               old_pct_of_read=100 * float(a.max()) / max(reads), new_pct_of_read=100 * float(b.max()) / max(reads),
               ratio_median=float(np.median(b / a)), new_wins=int(np.sum(b > a)),
               old_gbps=a.tolist(), new_gbps=b.tolist(), read_gbps=reads)
    print(f"  {model:13s} {kv_dtype} ctx {ctx:6d}: read {max(reads):5.1f}  old {a.max():5.1f}  new {b.max():5.1f} GB/s"
          f"  ({row['old_pct_of_read']:3.0f}% -> {row['new_pct_of_read']:3.0f}% of read)  new/old {row['ratio_median']:.3f}"
          f"  wins {row['new_wins']}/{args.rounds}{'' if identical else '  OUTPUTS DIFFER'}", flush=True)
    return row


def side(args, i: int) -> str:
    """What one side of a same-build A/B sets: its V layout and/or software prefetch."""
    return ((f", v_tile={args.v_tiles[i]}" if args.v_tiles else "")
            + (f", prefetch={args.prefetch[i]}" if args.prefetch else "")
            + (f", amx={args.amx[i]}" if args.amx else ""))


def plot(rows, path_png: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['model'].split('-')[0]} {r['kv_dtype']} {r['context']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["old_pct_of_read"] for r in rows], 0.4, label="old build")
    ax.bar(x + 0.2, [r["new_pct_of_read"] for r in rows], 0.4, label="new build")
    for i, r in enumerate(rows):
        ax.text(i, max(r["old_pct_of_read"], r["new_pct_of_read"]) + 1, f"{r['ratio_median']:.2f}x",
                ha="center", fontsize=7)
    ax.axhline(70, color="gray", ls=":", lw=1)
    ax.axhline(90, color="gray", ls="--", lw=1)
    ax.set_xticks(x, labels, fontsize=7, rotation=40, ha="right")
    ax.set_ylabel("% of DRAM read bandwidth (best, same run)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="a checkout of the earlier code with its extension built")
    ap.add_argument("--isa", default="avx2", help="which module to compare (avx512, avx2, portable)")
    ap.add_argument("--v-tiles", metavar="OLD,NEW", help="compare two V layouts of the current build instead "
                    "(e.g. 0,32: token-major vs tiles of 32 dims); no --old")
    ap.add_argument("--prefetch", metavar="OLD,NEW", help="software prefetch off (0), on (1) or scattered for each side, "
                    "current build (alone or with --v-tiles); no --old")
    ap.add_argument("--amx", metavar="OLD,NEW", help="the scores as AMX tile products for each side: off, on or "
                    "emulate (bf16 KV with bf16 queries), current build (alone or with the others); no --old")
    ap.add_argument("--label", help="result name (required unless --replot)")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores of the CPU set")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--contexts", default="128,1024,4096,16384")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--min-mb", type=int, default=768, help="KV megabytes per shape (past the caches)")
    ap.add_argument("--kv-kb", type=int, default=None,
                    help="KV kilobytes per shape instead of --min-mb: a set that stays in the caches (e.g. 700 "
                         "with --threads 1 for one core's L2) times the kernel's compute alone, the regime of "
                         "a host whose cores, not its DRAM, bound attention (the GPU box's Xeon)")
    ap.add_argument("--reps", type=int, default=3, help="calls per build per round (best taken)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier result file")
    args = ap.parse_args(argv)
    if not args.replot:
        check_args(ap, args)
    return args


def pair(ap, flag: str, value: str, allowed: tuple[str, ...]) -> tuple[str, str]:
    sides = tuple(value.split(","))
    if len(sides) != 2 or any(x not in allowed for x in sides):
        ap.error(f"{flag} must be OLD,NEW with each one of {', '.join(allowed)}, got {value!r}")
    return sides


def check_args(ap, args) -> None:
    """Exactly one of --old and the same-build sides; each side list a valid pair."""
    args.same_build = bool(args.v_tiles or args.prefetch or args.amx)
    if not args.label or not (args.old or args.same_build) or (args.old and args.same_build):
        ap.error("--label and either --old (a checkout of the earlier code with its extension built) "
                 "or --v-tiles OLD,NEW and/or --prefetch OLD,NEW and/or --amx OLD,NEW are required")
    if args.old and os.path.realpath(args.old) == os.path.realpath(REPO):
        ap.error("--old must be another checkout: one extension file cannot be loaded twice in a process")
    if args.v_tiles:
        try:
            args.v_tiles = tuple(int(x) for x in args.v_tiles.split(","))
            assert len(args.v_tiles) == 2
        except (ValueError, AssertionError):
            ap.error(f"--v-tiles must be two integers OLD,NEW, got {args.v_tiles!r}")
    if args.prefetch:
        args.prefetch = pair(ap, "--prefetch", args.prefetch, ("0", "1", "off", "on", "scattered"))
    if args.amx:
        args.amx = pair(ap, "--amx", args.amx, ("off", "on", "emulate"))
    if (args.kv_kb is not None and args.kv_kb < 1) or args.reps < 1:
        ap.error(f"--kv-kb and --reps must be >= 1, got {args.kv_kb} and {args.reps}")


def old_module(args):
    """The module the "old" side runs: the other checkout's build, or this one's for a same-build A/B."""
    runnable = isa_mod.available_isas() + isa_mod.emulated_isas()
    if args.isa not in runnable:
        sys.exit(f"kernel_ab: this CPU cannot run the {args.isa} path (it has {runnable})")
    if args.amx and "on" in args.amx and "amx-bf16" not in isa_mod.cpu_features():
        sys.exit("kernel_ab: --amx on needs a CPU with AMX-BF16 (this one has none; 'emulate' runs anywhere "
                 "AVX512-BF16 does, as a check, not a timing)")
    if not args.same_build:
        return load_old(args.old, args.isa)
    mod = isa_mod.load(args.isa)
    have = {mod.V_TILE, mod.V_TILE_ALT} | ({mod.V_PAIRS} if hasattr(mod, "V_PAIRS") else set())
    if args.v_tiles and not set(args.v_tiles) <= have:
        sys.exit(f"kernel_ab: the {args.isa} build has V layouts {sorted(have)}, not {list(args.v_tiles)}")
    return mod


def run_meta(args, old_mod) -> dict:
    return dict(label=args.label, isa=args.isa, threads=args.threads,
                old=os.path.abspath(args.old) if args.old else "this build" + side(args, 0),
                new="this build" + side(args, 1),
                old_rev=git_rev(args.old or REPO), new_rev=git_rev(REPO), new_tree_dirty=bool(subprocess.run(
                    ["git", "-C", REPO, "status", "--porcelain", "csrc"], capture_output=True, text=True).stdout),
                cpu=platform.processor() or platform.machine(), cpu_features=sorted(old_mod.cpu_features()),
                min_mb=args.min_mb, kv_kb=args.kv_kb, reps=args.reps, rounds=args.rounds,
                regime="in cache (compute only)" if args.kv_kb else "from DRAM")


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            res = json.load(f)
        m = res["meta"]
        plot(res["rows"], args.replot[:-5] + ".png", f"{m['isa']}, {m['threads']} threads: old vs new build, "
             f"interleaved in one run (label {m['label']}); text: median per-round ratio new/old")
        return
    args.threads = args.threads or default_threads()
    old_mod = old_module(args)
    rng = np.random.default_rng(0)
    rows = [ab_shape(args, old_mod, m, int(c), dt, rng)
            for dt in args.dtypes.split(",") for m in args.models.split(",") for c in args.contexts.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"kernel_ab_{args.label}")
    meta = run_meta(args, old_mod)
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, base + ".png", f"{args.isa}, {args.threads} threads, {meta['regime']}: old vs new build, interleaved "
                              f"in one run (label {args.label}); text: median per-round ratio new/old")
    print(f"wrote {base}.json, {base}.png")


if __name__ == "__main__":
    main()
