"""R-worker decode-attention benchmark: effective bandwidth against the machine's read bandwidth.

For the KV shapes of SmolLM2-135M (3 KV heads x 64, 9 query heads), Llama-3-8B (8 x 128, GQA 4)
and Llama-2-7B (32 x 128, MHA) at contexts 128 / 1024 / 4096 / 16384, with a batch that makes
>= 256 MB of bf16 KV, it times one decode-attention call (all sequences, one layer) of

  - each ISA path of rworker (avx512, avx2, portable, as the CPU allows) and KV dtype,
  - torch SDPA decode (bf16, fp16, fp32; enable_gqa) on the same data,
  - each rworker path again with a working set that stays in the last-level cache (its compute
    alone), and from it the no-overlap bound 1 / (1/cache + 1/read),

and measures, in the same run, the read bandwidth: the extension's multi-threaded streaming sum
and torch.sum, taking the best. Effective bandwidth = KV bytes read / time. The host is noisy, so
every figure is the best of several calls, and the read bandwidth is re-measured between shapes.

Also: the cost of appending one token for 1,024 sequences x 32 layers (Llama-3-8B shape, bf16)
relative to attention at context 1024, and prefill-append speed against a plain copy.

    python3 setup.py build_ext --inplace && python3 bench/kernel/kernel_bench.py --label h100-box
    python3 bench/kernel/kernel_bench.py --quick            # ~1 minute smoke run

Writes bench/kernel/results/kernel_<label>.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time

import numpy as np

# kernel_fixtures first: it puts this checkout and tests/ on sys.path
from kernel_fixtures import MODELS, RESULTS, best_time, bf16_bits_to_f32, f32_to_bf16_bits, fill_store, random_block
from kernel_ref import attention_ref

from rworker import KVStore
from rworker import isa as isa_mod
from rworker.bench import largest_cache_bytes
from rworker.host.threads import default_threads, pin_cpus
from rworker.protocol.kvformat import kv_itemsize

PATH_DTYPES = {"avx512": ("bf16", "fp16", "fp32"), "avx2": ("bf16", "fp32"), "portable": ("bf16",)}


class ReadBW:
    """Best-so-far read bandwidth: the extension's streaming loop and torch.sum."""

    def __init__(self, nbytes: int, threads: int, torch_mod):
        self.nbytes, self.threads, self.torch = nbytes, threads, torch_mod
        self.mod = isa_mod.load()
        self.ext, self.tsum = [], []
        self._tbuf = None

    def measure(self, reps: int = 4) -> float:
        """Measure again; returns the best of this measurement alone."""
        now = self.mod.read_bandwidth(self.nbytes, self.threads, reps, pin_cpus(self.threads))
        self.ext += now
        if self.torch is not None:
            if self._tbuf is None:
                self._tbuf = self.torch.ones(self.nbytes // 4, dtype=self.torch.float32)
            b = self._tbuf
            best, _ = best_time(lambda: b.sum(), reps)
            self.tsum.append(self.nbytes / best / 1e9)
            now = now + [self.tsum[-1]]
        return max(now)

    def release(self):
        self._tbuf = None

    @property
    def best(self) -> float:
        return max(self.ext + self.tsum)


def bench_shape(args, model, ctx, rbw, torch_mod, rng, results):
    Hkv, Hq, D, _ = MODELS[model]
    read_before = rbw.measure(2)     # a noisy host: also keep the read bandwidth next to this shape
    per_seq_bf16 = ctx * Hkv * D * 2 * 2
    B = max(1, -(-args.min_mb * 2**20 // per_seq_bf16))
    blk = random_block(rng, min(ctx, 1024), Hkv, D)
    q = bf16_bits_to_f32(f32_to_bf16_bits(rng.standard_normal((B, Hq, D), dtype=np.float32)))  # bf16 values
    q16 = f32_to_bf16_bits(q)   # what a bf16 S-worker ships: bf16 KV runs are timed with these bits
    ref0 = None                                               # float64 reference for sequence 0
    rows = []

    def record(path, kv_dtype, best, med, err):
        nbytes = B * ctx * Hkv * D * 2 * kv_itemsize(kv_dtype)
        q_dtype = kv_dtype if path == "torch_sdpa" else ("bf16" if kv_dtype == "bf16" else "fp32")
        rows.append(dict(model=model, Hkv=Hkv, Hq=Hq, D=D, context=ctx, batch=B, kv_dtype=kv_dtype, path=path,
                         q_dtype=q_dtype,
                         kv_bytes=nbytes, seconds=best, seconds_median=med, gbps=nbytes / best / 1e9,
                         max_abs_err_seq0=err))

    # 1. rworker paths
    for path in args.paths:
        for kv_dtype in PATH_DTYPES[path]:
            if kv_dtype not in args.dtypes:
                continue
            store = KVStore(1, Hkv, D, kv_dtype, threads=args.threads, isa=path)
            fill_store(store, blk, B, ctx, kv_dtype)
            out = np.empty_like(q)
            qin = q16 if kv_dtype == "bf16" else q
            ids = np.arange(B)
            best, med = best_time(lambda: store.attend(0, ids, qin, out), args.reps, args.min_time)
            if ref0 is None or kv_dtype != "bf16":
                kq = _stored(blk, ctx, kv_dtype)
                ref = attention_ref(q[0].astype(np.float64), kq, kq, 1 / np.sqrt(D))
                if kv_dtype == "bf16":
                    ref0 = ref
            else:
                ref = ref0
            record(path, kv_dtype, best, med, float(np.abs(out[0] - ref).max()))
            del store
            rows[-1].update(cache_resident(args, Hkv, D, ctx, kv_dtype, path, blk, qin))

    # 2. torch SDPA decode on the same data: q [B, Hq, 1, D], k = v [B, Hkv, ctx, D]
    if torch_mod is not None and not args.no_torch:
        F = torch_mod.nn.functional
        tok = np.arange(ctx) % len(blk)
        for kv_dtype in args.dtypes:
            tdt = {"bf16": torch_mod.bfloat16, "fp16": torch_mod.float16, "fp32": torch_mod.float32}[kv_dtype]
            base = torch_mod.from_numpy(bf16_bits_to_f32(blk)[tok].transpose(1, 0, 2).copy()).to(tdt)  # [Hkv, ctx, D]
            k = base.unsqueeze(0).expand(B, Hkv, ctx, D).contiguous()
            tq = torch_mod.from_numpy(q).to(tdt).unsqueeze(2)
            with torch_mod.inference_mode():
                def run():
                    return F.scaled_dot_product_attention(tq, k, k, enable_gqa=Hq != Hkv)
                o = run()
                best, med = best_time(run, args.reps, args.min_time)
            err = float((o[0, :, 0].float().numpy() - ref0).__abs__().max()) if ref0 is not None else float("nan")
            record("torch_sdpa", kv_dtype, best, med, err)
            del k, base, o

    # 3. read bandwidth again, right after the shape (the run's best is the headline reference)
    adjacent = max(read_before, rbw.measure(2))
    for r in rows:
        r["adjacent_read_gbps"] = adjacent
        r["pct_of_adjacent_read_bw"] = 100 * r["gbps"] / adjacent
        if "cache_gbps" in r:      # no overlap of compute and memory at all would give this
            r["no_overlap_gbps"] = 1 / (1 / r["cache_gbps"] + 1 / adjacent)
        cached = (f"  in cache {r['cache_gbps']:6.1f}, no-overlap bound {r['no_overlap_gbps']:5.1f} GB/s"
                  if "cache_gbps" in r else "")
        print(f"  {model:13s} ctx {ctx:6d} B {B:5d}  {r['path']:10s} {r['kv_dtype']:5s} "
              f"{r['gbps']:7.1f} GB/s  err {r['max_abs_err_seq0']:.1e}{cached}", flush=True)
    results += rows


CACHE_WS_MAX = 8 << 20      # bytes of KV in a cache-resident timing


def cache_resident(args, Hkv, D, ctx, kv_dtype, path, blk, q) -> dict:
    """The same path and shape with a KV working set that stays in the last-level cache
    (<= 8 MB, <= a quarter of it): what the kernel's compute alone streams, in GB/s of KV. With
    the DRAM read bandwidth it bounds the DRAM figure between no overlap of compute and memory,
    1 / (1/cache + 1/read), and full overlap, min(cache, read)."""
    ws = args.cache_ws
    per_token = Hkv * D * 2 * kv_itemsize(kv_dtype)
    seqs = 2 * args.threads
    ctx_c = max(32, min(ctx, ws // (seqs * per_token) // 32 * 32))
    seqs = max(seqs, ws // (ctx_c * per_token))
    store = KVStore(1, Hkv, D, kv_dtype, threads=args.threads, isa=path)
    fill_store(store, blk, seqs, ctx_c, kv_dtype)
    qc = np.ascontiguousarray(np.resize(q, (seqs,) + q.shape[1:]))
    out = np.empty(qc.shape, np.float32)
    ids = np.arange(seqs)
    best, _ = best_time(lambda: store.attend(0, ids, qc, out), args.reps, args.min_time)
    return {"cache_gbps": seqs * ctx_c * per_token / best / 1e9, "cache_context": ctx_c, "cache_batch": seqs,
            "cache_kv_bytes": seqs * ctx_c * per_token}


def _stored(blk, ctx, kv_dtype):
    """float64 K (= V) of sequence 0 as the store holds it."""
    x = bf16_bits_to_f32(blk)[np.arange(ctx) % len(blk)]
    if kv_dtype == "fp16":
        x = x.astype(np.float16)
    return x.astype(np.float64)


def bench_append(args, attn_gbps: float | None):
    """1,024 sequences x 32 layers, one token each per step (Llama-3-8B shape, bf16 in and stored)."""
    Hkv, Hq, D, L = MODELS["llama3-8b"]
    nseq, steps, layers = 1024, (16 if args.quick else 64), (2 if args.quick else 4)
    rng = np.random.default_rng(5)
    store = KVStore(layers, Hkv, D, "bf16", threads=args.threads, isa=args.paths[0])
    ids = np.arange(nseq, dtype=np.int64)
    kv = [random_block(rng, nseq, Hkv, D) for _ in range(4)]
    for layer in range(layers):                      # sequences exist, mid-page
        store.append(layer, ids, kv[0], kv[1])
    t0 = time.perf_counter()
    for s in range(steps):
        for layer in range(layers):
            store.append(layer, ids, kv[s % 4], kv[(s + 1) % 4])
    per_layer_step = (time.perf_counter() - t0) / (steps * layers)
    res = dict(model="llama3-8b", kv_dtype="bf16", sequences=nseq, steps=steps, layers_measured=layers,
               append_seconds_per_layer_step=per_layer_step, append_seconds_per_step_32_layers=per_layer_step * L)
    if attn_gbps:
        attn = nseq * 1024 * Hkv * D * 2 * 2 / (attn_gbps * 1e9)   # one layer at context 1024
        res.update(attention_seconds_per_layer_ctx1024=attn, append_over_attention=per_layer_step / attn)
    del store

    # prefill: one 4096-token prompt, fp32 -> bf16 and bf16 -> bf16, vs a plain copy of the bytes
    n = 4096
    k32 = rng.standard_normal((n, Hkv, D), dtype=np.float32)
    k16 = f32_to_bf16_bits(k32)
    stored = 2 * n * Hkv * D * 2
    st = KVStore(1, Hkv, D, "bf16", threads=args.threads, isa=args.paths[0])
    for name, src in (("fp32_in", k32), ("bf16_in", k16)):
        def prefill():
            st.append(0, np.zeros(n, np.int64), src, src)
            st.free(0)                                    # pages return to the free list: arena warm
        best, _ = best_time(prefill, args.reps)
        res[f"prefill_{name}_gbps_written"] = stored / best / 1e9
    del st
    dst = np.empty(stored // 2, np.uint16)
    srcc = np.concatenate([k16.ravel(), k16.ravel()])
    best, _ = best_time(lambda: np.copyto(dst, srcc), args.reps)
    res["memcpy_gbps_same_bytes"] = stored / best / 1e9
    return res


def plot(results, rbw_best, path_png, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r["model"] == m for r in results)]
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), sharey=True, squeeze=False)
    styles = {"avx512": "-", "avx2": "--", "portable": ":", "torch_sdpa": "-."}
    colors = {"bf16": "tab:blue", "fp16": "tab:green", "fp32": "tab:red"}
    for ax, m in zip(axes[0], models):
        for path in styles:
            for dt in colors:
                pts = sorted((r["context"], 100 * r["gbps"] / rbw_best) for r in results
                             if r["model"] == m and r["path"] == path and r["kv_dtype"] == dt)
                if pts:
                    ax.plot(*zip(*pts), styles[path], color=colors[dt], marker="o", ms=3, label=f"{path} {dt}")
        ax.axhline(90, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(m)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"% of read bandwidth ({rbw_best:.0f} GB/s)")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path_png, dpi=110)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default=None, help="result name (default: hostname)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (~1 minute)")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores of the CPU set")
    ap.add_argument("--paths", default=None, help="comma list of ISA paths (default: all the CPU runs)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--contexts", default=None, help="default 128,1024,4096,16384")
    ap.add_argument("--min-mb", type=int, default=None,
                    help="bf16 KV megabytes per shape; default max(256, 3 x the largest cache) so it streams from DRAM")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--min-time", type=float, default=None, help="seconds of repeated calls per figure")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier result file")
    return ap.parse_args(argv)


def settle_defaults(args) -> None:
    """Fill in what depends on the host: threads, ISA paths, working-set size, repetitions."""
    args.threads = args.threads or default_threads()
    args.paths = args.paths.split(",") if args.paths else isa_mod.available_isas()
    args.dtypes = args.dtypes.split(",")
    args.models = args.models.split(",")
    ctx_default = "128,1024,16384" if args.quick else "128,1024,4096,16384"
    args.contexts = [int(c) for c in (args.contexts or ctx_default).split(",")]
    args.cache = largest_cache_bytes()
    args.min_mb = args.min_mb or max(128 if args.quick else 256, 3 * args.cache // 2**20)
    args.cache_ws = min(CACHE_WS_MAX, args.cache // 4)
    args.reps = args.reps or (3 if args.quick else 7)
    args.min_time = args.min_time if args.min_time is not None else (0.0 if args.quick else 0.3)
    args.label = args.label or socket.gethostname()


def cpu_model_name() -> str:
    if not os.path.exists("/proc/cpuinfo"):
        return platform.processor()
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())


def write_json(args, run: dict, results: list[dict], rbw: ReadBW, append: dict | None) -> float:
    """Results so far, against the best read bandwidth so far; `partial` until the end, so a run
    cut by a time limit (a lent GPU box) still leaves every finished shape. Returns that best."""
    best = rbw.best
    for r in results:
        r["pct_of_read_bw"] = 100 * r["gbps"] / best
        sdpa = next((x for x in results if x["path"] == "torch_sdpa" and x["kv_dtype"] == "bf16"
                     and x["model"] == r["model"] and x["context"] == r["context"]), None)
        r["x_torch_sdpa_bf16"] = r["gbps"] / sdpa["gbps"] if sdpa else None
    torch_mod = run["torch"]
    out = dict(
        label=args.label, host=socket.gethostname(), cpu=run["cpu"], cpu_features=run["features"],
        threads=args.threads, logical_cpus=os.cpu_count(), python=platform.python_version(), numpy=np.__version__,
        torch=getattr(torch_mod, "__version__", None), quick=args.quick, min_mb=args.min_mb, reps=args.reps,
        largest_cache_bytes=args.cache,
        selected_isa=isa_mod.selected_isa(), wall_seconds=time.time() - run["t_start"], partial=append is None,
        read_bw=dict(ext_gbps=rbw.ext, torch_sum_gbps=rbw.tsum, best_gbps=best, bytes=rbw.nbytes),
        results=results, append=append,
    )
    with open(run["json"] + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(run["json"] + ".tmp", run["json"])
    return best


def print_summary(results: list[dict], best: float, append: dict) -> None:
    print(f"\nread bandwidth (best of ext + torch.sum, this run): {best:.1f} GB/s")
    print("%read: of the run's best read bandwidth; %adj: of the best read measured just before/after the shape")
    print(f"{'model':13s} {'ctx':>6s} {'path':10s} {'kv':5s} {'GB/s':>7s} {'%read':>6s} {'%adj':>5s} {'xSDPAbf16':>9s}")
    for r in results:
        x = f"{r['x_torch_sdpa_bf16']:.2f}" if r["x_torch_sdpa_bf16"] else "-"
        print(f"{r['model']:13s} {r['context']:6d} {r['path']:10s} {r['kv_dtype']:5s} {r['gbps']:7.1f} "
              f"{r['pct_of_read_bw']:5.0f}% {r['pct_of_adjacent_read_bw']:4.0f}% {x:>9s}")
    if "append_over_attention" in append:
        print(f"append 1024 seqs x 32 layers: {append['append_seconds_per_step_32_layers'] * 1e3:.2f} ms/step = "
              f"{100 * append['append_over_attention']:.2f}% of attention at context 1024")


def import_torch(threads: int):
    try:
        import torch
    except ImportError:
        print("torch not installed: no torch.sum / SDPA comparison", flush=True)
        return None
    torch.set_num_threads(threads)
    return torch


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            d = json.load(f)
        png = os.path.splitext(args.replot)[0] + ".png"
        plot(d["results"], d["read_bw"]["best_gbps"], png, f"{d['label']}: {d['cpu']}, {d['threads']} threads")
        print(f"wrote {png}")
        return
    settle_defaults(args)
    torch = import_torch(args.threads)
    run = dict(torch=torch, cpu=cpu_model_name(), features=sorted(isa_mod.cpu_features()), t_start=time.time(),
               json=os.path.join(args.out_dir, f"kernel_{args.label}.json"))
    print(f"kernel_bench {args.label}: {run['cpu']}, threads {args.threads}, paths {args.paths}, "
          f"torch {getattr(torch, '__version__', None)}", flush=True)
    print(f"largest cache {args.cache / 2**20:.0f} MiB -> KV working set >= {args.min_mb} MB per shape", flush=True)
    rbw = ReadBW(max(args.min_mb, 512) * 2**20 * 2, args.threads, torch)
    rbw.measure(4)
    print(f"read bandwidth: ext best {max(rbw.ext):.1f} GB/s, torch.sum best "
          f"{max(rbw.tsum) if rbw.tsum else float('nan'):.1f} GB/s", flush=True)

    rng = np.random.default_rng(0)
    results: list[dict] = []
    os.makedirs(args.out_dir, exist_ok=True)
    for model in args.models:
        for ctx in args.contexts:
            bench_shape(args, model, ctx, rbw, torch, rng, results)
            write_json(args, run, results, rbw, None)
    rbw.measure(4)
    rbw.release()
    write_json(args, run, results, rbw, None)

    attn = next((r["gbps"] for r in results if r["path"] == args.paths[0] and r["kv_dtype"] == "bf16"
                 and r["model"] == "llama3-8b" and r["context"] == 1024), None)
    append = bench_append(args, attn)
    print(f"append: {append}", flush=True)
    best = write_json(args, run, results, rbw, append)
    print_summary(results, best, append)
    try:
        png = os.path.join(args.out_dir, f"kernel_{args.label}.png")
        plot(results, best, png, f"{args.label}: {run['cpu']}, {args.threads} threads")
        print(f"wrote {run['json']} and {png}")
    except ImportError:
        print(f"wrote {run['json']} (matplotlib missing: no plot)")


if __name__ == "__main__":
    main()
