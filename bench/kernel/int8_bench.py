"""int8 KV against bf16 (and fp32) KV: decode attention, the VNNI passes, and the append, in one run.

Every ratio is taken within one run, and every timed figure is a median over interleaved
rounds, so that the drift of a shared host hits all sides alike:

1. Decode attention, one `attend` call (all sequences, one layer), for the KV shapes of
   SmolLM2-135M (3 KV heads x 64, 9 query heads), Llama-3-8B (8 x 128, 32) and Llama-2-7B
   (32 x 128, 32) at contexts 1024 / 4096 / 16384. Per (shape, context) one store per side holds
   the same sequences (enough that the int8 store alone is >= max(256 MB, 2 x the largest cache)):
     int8          the default passes (vpdpbusd where the CPU has AVX512-VNNI), bf16 queries
     int8_novnni   the same store format built with FASTDECODE_VNNI=0 (vpmaddubsw), bf16 queries
     bf16          bf16 queries (uint16 bits, as a bf16 S-worker ships them)
     fp32          fp32 queries (the reference; the same bf16 values)
   Each round calls every side once in a rotated order (A/B/C/D, B/C/D/A, ...) and measures the
   read bandwidth once (rworker's streaming loop, same thread count); the read is measured also
   right before and after the rounds. Reported: tokens/s = sequences x context / median seconds;
   GB/s = bytes_committed() / median seconds (the pages attend streams: K, V and the int8 scales;
   bytes_used() also counts the free pages of each sequence's last extent, 7 pages per sequence
   and head with these appends, +22% at context 1024, so `gbps_bytes_used` overstates it), as % of
   the median of those read measurements (`pct_of_read`; `pct_of_read_best` against their best);
   int8 / bf16 as the median of the per-round speed ratios (`int8_over_bf16`, with the rounds
   int8 won), and VNNI / no-VNNI alike. The output of sequence 0 is checked against a float64
   reference of the stored bf16 values (`max_abs_err_seq0`).
2. Decode append: after the rounds, 32 steps of one append call of B rows (one new token per
   sequence; bf16 rows into the int8 and bf16 stores, fp32 rows into the fp32 store), the sides
   interleaved step by step, each call after a 2 ms pause (its store's pool asleep, as after a
   wait for the S-worker; that wake-up is ~30-40 us of the call): median seconds per call (and
   the mean and max over the 32 steps), and the int8 append as % of the int8 attention of that
   batch.
3. Prefill append: one call with a 1,024-token prompt for each of a batch of sequences, into
   int8 and bf16 stores, from bf16 and from fp32 rows, in GB/s of input (K and V rows), against
   a plain copy of the same input bytes.

    python3 bench/kernel/int8_bench.py --label devbox-2core-xeon     # ~3-5 minutes, ~9 GB peak RSS
    python3 bench/kernel/int8_bench.py --quick --out-dir /tmp/bench  # ~30 s smoke run

Writes bench/kernel/results/int8_<label>.json and .png (the comparisons, the summary table and the
plot: int8_report.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import subprocess
import time

import numpy as np

# kernel_fixtures first (int8_report, sorted before it, imports it first): it puts this checkout
# (and tests/) on sys.path
from int8_report import compare, plot, print_summary, targets
from kernel_fixtures import MODELS, REPO, RESULTS, bf16_bits_to_f32, f32_to_bf16_bits, fill_store, random_block
from kernel_ref import attention_ref

from rworker import KVStore
from rworker import isa as isa_mod
from rworker.bench import largest_cache_bytes
from rworker.host.threads import default_threads, pin_cpus
from rworker.protocol.kvformat import kv_token_bytes

# side: (store dtype, FASTDECODE_VNNI for the store, query / append-row dtype)
SIDES = {
    "int8": ("int8", None, "bf16"),
    "int8_novnni": ("int8", "0", "bf16"),
    "bf16": ("bf16", None, "bf16"),
    "fp32": ("fp32", None, "fp32"),
}
APPEND_SIDES = ("int8", "bf16", "fp32")     # int8_novnni appends with the same code as int8
APPEND_STEPS = 32                            # one page of tokens
PREFILL_TOKENS = 1024
SPIN_GAP_S = 0.002                           # > FASTDECODE_SPIN_US (50 us): one store's idle pool
                                             # stops spinning before the next side is timed


class Read:
    """The extension's streaming read (its own pinned pool), GB/s per repetition."""

    def __init__(self, nbytes: int, threads: int):
        self.mod, self.nbytes, self.threads, self.cpus = isa_mod.load(None), nbytes, threads, pin_cpus(threads)

    def __call__(self, reps: int) -> list[float]:
        return list(self.mod.read_bandwidth(self.nbytes, self.threads, reps, self.cpus))


def make_store(args, side: str, Hkv: int, D: int) -> KVStore:
    kv_dtype, vnni_env, _ = SIDES[side]
    saved = os.environ.get("FASTDECODE_VNNI")
    if vnni_env is not None:
        os.environ["FASTDECODE_VNNI"] = vnni_env       # read when the store is built
    try:
        return KVStore(1, Hkv, D, kv_dtype, threads=args.threads, isa=args.isa)
    finally:
        if saved is None:
            os.environ.pop("FASTDECODE_VNNI", None)
        else:
            os.environ["FASTDECODE_VNNI"] = saved


def rotated(names, r: int):
    return names[r % len(names):] + names[:r % len(names)]


def fill_stores(args, blk: np.ndarray, B: int, ctx: int, Hkv: int, D: int) -> tuple[dict, float]:
    """A store per side holding the same B sequences of `ctx` tokens; and the seconds that took."""
    t0 = time.perf_counter()
    stores = {}
    for side in args.sides:
        st = make_store(args, side, Hkv, D)
        fill_store(st, blk, B, ctx, st.kv_dtype)
        stores[side] = st
    return stores, time.perf_counter() - t0


def warm_up(args, stores: dict, ids, qin: dict, q: np.ndarray, blk: np.ndarray, D: int):
    """A warm-up call per side: the outputs, each side's error on sequence 0 against the float64
    reference, and whether the VNNI and no-VNNI passes agree (identical, max abs difference)."""
    B, Hq = q.shape[0], q.shape[1]
    outs = {s: np.empty((B, Hq, D), np.float32) for s in args.sides}
    for s in args.sides:
        stores[s].attend(0, ids, qin[SIDES[s][2]], outs[s])
    ref = attention_ref(q[0].astype(np.float64), bf16_bits_to_f32(blk).astype(np.float64),   # ctx % len(blk) == 0:
                        bf16_bits_to_f32(blk).astype(np.float64), 1 / np.sqrt(D))           # one period suffices
    err = {s: float(np.abs(outs[s][0] - ref).max()) for s in args.sides}
    vnni_same = (bool(np.array_equal(outs["int8"], outs["int8_novnni"])),
                 float(np.abs(outs["int8"] - outs["int8_novnni"]).max())) if "int8_novnni" in outs else (None, None)
    return outs, err, vnni_same


def attention_rounds(args, stores: dict, ids, qin: dict, out: np.ndarray, read: Read) -> tuple[dict, list[float]]:
    """The interleaved rounds: seconds per side and round, and the reads before, during and after."""
    reads_before = read(3)
    reads_rounds = []
    secs = {s: [] for s in args.sides}
    for r in range(args.rounds):
        reads_rounds += read(2)
        for s in rotated(list(args.sides), r):
            time.sleep(SPIN_GAP_S)
            qs = qin[SIDES[s][2]]
            t = time.perf_counter()
            stores[s].attend(0, ids, qs, out)
            secs[s].append(time.perf_counter() - t)
    reads_after = read(3)
    return secs, reads_before + reads_rounds + reads_after


def attention_rows(args, model: str, ctx: int, B: int, stores: dict, secs: dict, reads: list[float],
                   err: dict) -> list[dict]:
    """A result row per side from its rounds and its store's bytes (taken before any append)."""
    Hkv, Hq, D, _ = MODELS[model]
    read_med, read_best = float(np.median(reads)), float(max(reads))
    rows = []
    for s in args.sides:
        st, ts = stores[s], np.array(secs[s])
        med = float(np.median(ts))
        used, committed = st.bytes_used(), st.bytes_committed()
        formula = B * ctx * kv_token_bytes(st.kv_dtype, Hkv, D)
        gbps = committed / med / 1e9           # the pages attend streams (bytes_used adds the extents' slack)
        rows.append(dict(model=model, Hkv=Hkv, Hq=Hq, D=D, context=ctx, batch=B, side=s, kv_dtype=st.kv_dtype,
                         q_dtype=SIDES[s][2], isa=st.isa, vnni=st.vnni, prefetch=st.prefetch,
                         bytes_used=used, bytes_committed=committed, kv_bytes_formula=formula,
                         seconds=ts.tolist(), seconds_median=med, seconds_best=float(ts.min()),
                         tokens_per_s=B * ctx / med, gbps=gbps, gbps_best=committed / float(ts.min()) / 1e9,
                         read_median_gbps=read_med, read_best_gbps=read_best,
                         pct_of_read=100 * gbps / read_med, pct_of_read_best=100 * gbps / read_best,
                         gbps_bytes_used=used / med / 1e9, pct_of_read_bytes_used=100 * used / med / 1e9 / read_med,
                         max_abs_err_seq0=err[s]))
        if committed != formula:
            print(f"  note: {model} ctx {ctx} {s}: bytes_committed {committed} != K+V+scales {formula}", flush=True)
    return rows


def decode_appends(stores: dict, rows: list[dict], ids, rng, B: int, Hkv: int, D: int) -> dict:
    """Decode append at this context, one row per sequence, the sides interleaved per step: seconds
    per call and side, also added to each side's row with their share of its own attention."""
    app_in = {"bf16": random_block(rng, B, Hkv, D)}
    app_in["fp32"] = bf16_bits_to_f32(app_in["bf16"])
    app_sides = [s for s in APPEND_SIDES if s in stores]
    app = {s: [] for s in app_sides}
    for step in range(APPEND_STEPS):
        for s in rotated(app_sides, step):
            x = app_in[SIDES[s][2]]
            time.sleep(SPIN_GAP_S)
            t = time.perf_counter()
            stores[s].append(0, ids, x, x)
            app[s].append(time.perf_counter() - t)
    by_side = {r["side"]: r for r in rows}
    for s in app_sides:
        r = by_side[s]
        r.update(append_in_dtype=SIDES[s][2], append_seconds=app[s], append_seconds_median=float(np.median(app[s])),
                 append_seconds_mean=float(np.mean(app[s])), append_seconds_max=float(np.max(app[s])),
                 append_pct_of_own_attention=100 * float(np.median(app[s])) / r["seconds_median"])
    return app


def bench_point(args, model: str, ctx: int, read: Read, rng) -> tuple[list[dict], dict]:
    """One (shape, context): the attention rounds, then the decode appends, on the same stores."""
    Hkv, Hq, D, _ = MODELS[model]
    B = max(2 * args.threads, -(-args.min_mb * 2**20 // (ctx * kv_token_bytes("int8", Hkv, D))))
    blk = random_block(rng, min(ctx, 1024), Hkv, D)                     # K = V data, bf16 bits
    q = bf16_bits_to_f32(random_block(rng, B, Hq, D))                   # bf16 values as fp32
    qin = {"bf16": f32_to_bf16_bits(q), "fp32": q}
    ids = np.arange(B, dtype=np.int64)

    stores, fill_s = fill_stores(args, blk, B, ctx, Hkv, D)
    outs, err, vnni_same = warm_up(args, stores, ids, qin, q, blk, D)   # its output checked, then the rounds
    secs, reads = attention_rounds(args, stores, ids, qin, outs[args.sides[0]], read)
    rows = attention_rows(args, model, ctx, B, stores, secs, reads, err)
    app = decode_appends(stores, rows, ids, rng, B, Hkv, D)
    del stores
    gc.collect()
    cmp = compare(rows, secs, app, vnni_same, reads, args.rounds,
                  model=model, context=ctx, batch=B, fill_seconds=fill_s)

    by_side = {r["side"]: r for r in rows}
    line = "  ".join(f"{s} {by_side[s]['tokens_per_s'] / 1e6:6.2f} M tok/s {by_side[s]['pct_of_read']:3.0f}%"
                     for s in args.sides)
    extra = f"  int8/bf16 {cmp['int8_over_bf16']:.2f}x" if "int8_over_bf16" in cmp else ""
    extra += f"  vnni/novnni {cmp['vnni_over_novnni']:.2f}x" if "vnni_over_novnni" in cmp else ""
    print(f"  {model:13s} ctx {ctx:6d} B {B:5d}  read {cmp['read_median_gbps']:5.1f} GB/s  {line}{extra}  "
          f"(fill {fill_s:.1f}s)", flush=True)
    return rows, cmp


def bench_prefill(args, model: str, rng) -> list[dict]:
    """One append call holding a 1,024-token prompt for each of `n` sequences, into a store whose
    arena is warm (the pages freed after each call), int8 and bf16, from bf16 and fp32 rows."""
    Hkv, Hq, D, _ = MODELS[model]
    in_row = 2 * Hkv * D * 2                                           # bf16 K + V bytes per token
    n = max(1, args.prefill_mb * 2**20 // (PREFILL_TOKENS * in_row))
    ids = np.repeat(np.arange(n, dtype=np.int64), PREFILL_TOKENS)
    x16 = random_block(rng, n * PREFILL_TOKENS, Hkv, D)
    xin = {"bf16": x16, "fp32": bf16_bits_to_f32(x16)}
    kinds = [(kv, src) for kv in ("int8", "bf16") for src in ("bf16", "fp32")]
    stores = {kv: KVStore(1, Hkv, D, kv, threads=args.threads, isa=args.isa) for kv in ("int8", "bf16")}
    written = {}

    def call(kv, src):
        st = stores[kv]
        st.append(0, ids, xin[src], xin[src])
        written[kv] = st.bytes_committed()
        for i in range(n):
            st.free(i)

    for k in kinds:                                                     # warm: the arena's pages touched
        call(*k)
    secs = {k: [] for k in kinds}
    for r in range(args.prefill_reps):
        for k in rotated(kinds, r):
            time.sleep(SPIN_GAP_S)
            t = time.perf_counter()
            call(*k)                                                    # the frees are timed too (cheap)
            secs[k].append(time.perf_counter() - t)
    stores.clear()
    copy = {}
    for src, x in xin.items():                                          # a plain copy of the same input bytes
        dst = np.empty((2,) + x.shape, x.dtype)
        ts = []
        for _ in range(args.prefill_reps):
            t = time.perf_counter()
            np.copyto(dst[0], x)
            np.copyto(dst[1], x)
            ts.append(time.perf_counter() - t)
        copy[src] = 2 * x.nbytes / float(np.median(ts)) / 1e9
        del dst
    rows = []
    for kv, src in kinds:
        med = float(np.median(secs[(kv, src)]))
        in_bytes = 2 * xin[src].nbytes
        rows.append(dict(model=model, Hkv=Hkv, Hq=Hq, D=D, sequences=n, prompt_tokens=PREFILL_TOKENS,
                         kv_dtype=kv, in_dtype=src, input_bytes=in_bytes, stored_bytes=written[kv],
                         seconds=secs[(kv, src)], seconds_median=med, input_gbps=in_bytes / med / 1e9,
                         stored_gbps=written[kv] / med / 1e9, copy_gbps_same_input=copy[src]))
    for src in ("bf16", "fp32"):
        i8 = next(r for r in rows if r["kv_dtype"] == "int8" and r["in_dtype"] == src)
        b16 = next(r for r in rows if r["kv_dtype"] == "bf16" and r["in_dtype"] == src)
        i8["int8_over_bf16_input_gbps"] = i8["input_gbps"] / b16["input_gbps"]
    print("  prefill " + model + ": " + "  ".join(
        f"{r['kv_dtype']}<-{r['in_dtype']} {r['input_gbps']:5.2f}" for r in rows)
        + f" GB/s of input (copy {copy['bf16']:.1f})", flush=True)
    return rows


def cpu_model_name() -> str:
    if not os.path.exists("/proc/cpuinfo"):
        return platform.processor()
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())


def git(*cmd: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def build_info() -> dict:
    """The commit, whether csrc/ differs from it, and whether the loaded module is older than a
    kernel source (then the run measures an earlier build than the tree shows)."""
    so = isa_mod.load(None).__file__
    src_dir = os.path.join(REPO, "csrc", "avx512")
    srcs = [os.path.join(src_dir, f) for f in os.listdir(src_dir)]
    newer = sorted(os.path.relpath(f, REPO) for f in srcs if os.path.getmtime(f) > os.path.getmtime(so))
    return dict(rev=git("rev-parse", "--short", "HEAD") or None, csrc_dirty=bool(git("status", "--porcelain", "csrc")),
                module=os.path.relpath(so, REPO), sources_newer_than_module=newer)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default=None, help="result name (default: hostname)")
    ap.add_argument("--quick", action="store_true", help="smaller stores, 2 contexts, 3 rounds (~30 s)")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores of the CPU set")
    ap.add_argument("--isa", default=None, help="ISA path of the stores (default: the CPU's best)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--contexts", default=None, help="default 1024,4096,16384 (quick: 1024,4096)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"subset of {','.join(SIDES)}")
    ap.add_argument("--min-mb", type=int, default=None,
                    help="int8 KV megabytes per (shape, context), bf16 twice and fp32 ~4x that; default "
                         "max(256, 2 x the largest cache) (quick: 128)")
    ap.add_argument("--read-mb", type=int, default=None, help="read-bandwidth buffer (default 512, quick 256)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per point (default 11, quick 3)")
    ap.add_argument("--prefill-mb", type=int, default=None,
                    help="bf16 K+V input per prefill call (default 256, quick 64)")
    ap.add_argument("--prefill-reps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no attention point after this many seconds (default 270, quick 60)")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier result file")
    return ap.parse_args(argv)


def settle_defaults(args) -> None:
    args.threads = args.threads or default_threads()
    args.models = args.models.split(",")
    args.contexts = [int(c) for c in (args.contexts or ("1024,4096" if args.quick else "1024,4096,16384")).split(",")]
    bad = [c for c in args.contexts if c % 1024]
    if bad:
        raise SystemExit(f"contexts must be multiples of 1024 (the reference uses one 1,024-token period): {bad}")
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = set(args.sides) - set(SIDES)
    if unknown:
        raise SystemExit(f"unknown sides {sorted(unknown)}; choose from {list(SIDES)}")
    args.cache = largest_cache_bytes()
    args.min_mb = args.min_mb or (128 if args.quick else max(256, 2 * args.cache // 2**20))
    args.read_mb = args.read_mb or (256 if args.quick else 512)
    args.rounds = args.rounds or (3 if args.quick else 11)
    args.prefill_mb = args.prefill_mb or (64 if args.quick else 256)
    args.prefill_reps = args.prefill_reps or (3 if args.quick else 5)
    args.budget_s = args.budget_s if args.budget_s is not None else (60.0 if args.quick else 270.0)
    args.label = args.label or socket.gethostname()


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            d = json.load(f)
        png = os.path.splitext(args.replot)[0] + ".png"
        plot(d, png)
        print(f"wrote {png}")
        return
    settle_defaults(args)
    t_start = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"int8_{args.label}")
    cpu = cpu_model_name()
    print(f"int8_bench {args.label}: {cpu}, threads {args.threads}, isa {isa_mod.choose_isa(args.isa)}, "
          f"sides {args.sides}", flush=True)
    print(f"largest cache {args.cache / 2**20:.0f} MiB -> int8 KV >= {args.min_mb} MB per point "
          f"(bf16 ~{2 * args.min_mb}, fp32 ~{4 * args.min_mb}); read buffer {args.read_mb} MiB", flush=True)
    b = build_info()
    if b["sources_newer_than_module"]:
        print(f"WARNING: {', '.join(b['sources_newer_than_module'])} newer than {b['module']}: rebuild "
              f"(python3 setup.py build_ext --inplace) to measure the sources as they are", flush=True)
    read = Read(args.read_mb << 20, args.threads)
    first = read(4)
    print(f"read bandwidth: {' '.join(f'{x:.1f}' for x in first)} GB/s", flush=True)

    d = dict(label=args.label, host=socket.gethostname(), cpu=cpu, cpu_features=sorted(isa_mod.cpu_features()),
             threads=args.threads, logical_cpus=os.cpu_count(), python=platform.python_version(),
             numpy=np.__version__, build=build_info(), isa=isa_mod.choose_isa(args.isa), quick=args.quick,
             min_mb=args.min_mb, read_mb=args.read_mb, rounds=args.rounds, largest_cache_bytes=args.cache,
             append_steps=APPEND_STEPS, prefill_tokens=PREFILL_TOKENS, env={k: v for k, v in os.environ.items()
                                                                             if k.startswith("FASTDECODE_")},
             read_start_gbps=first, partial=True, skipped=[], results=[], comparisons=[], prefill=[])

    def write():
        d["wall_seconds"] = time.time() - t_start
        d["targets"] = targets(d["comparisons"], d["results"])
        with open(base + ".json.tmp", "w") as f:
            json.dump(d, f, indent=1)
        os.replace(base + ".json.tmp", base + ".json")

    rng = np.random.default_rng(0)
    for ctx in args.contexts:                      # context outermost: a budget cut drops the longest ones
        for model in args.models:
            if time.time() - t_start > args.budget_s:
                d["skipped"].append(dict(model=model, context=ctx, why=f"past --budget-s {args.budget_s:.0f}"))
                print(f"  {model} ctx {ctx}: skipped (past the {args.budget_s:.0f} s budget)", flush=True)
                continue
            rows, cmp = bench_point(args, model, ctx, read, rng)
            d["results"] += rows
            d["comparisons"].append(cmp)
            write()
    for model in args.models:
        d["prefill"] += bench_prefill(args, model, rng)
    d["read_end_gbps"] = read(4)
    d["partial"] = False
    write()
    print_summary(d)
    try:
        plot(d, base + ".png")
        print(f"wrote {base}.json and {base}.png ({d['wall_seconds']:.0f} s)")
    except ImportError:
        print(f"wrote {base}.json (matplotlib missing: no plot; {d['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
