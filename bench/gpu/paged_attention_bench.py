"""The device KV tier's paged decode attention against the card's read bandwidth, same run.

One layer of Llama-3-8B's attention (32 query / 8 KV heads x 128, bf16, pages of 16 tokens
scattered over the cache in shuffled order) at B rows x C keys each, through
fastdecode.rpart.paged_attention (the Triton kernel, its split-KV plan chosen as in serving).
Achieved read bandwidth = the bytes it must read (each row's K and V, its query and output) over
the median time of several timed rounds (CUDA events; each round enough calls for >= 5 ms).

The limits and the peer, measured in the same process:
- `copy_gbps`: a device-to-device copy of 2 GiB (bytes read + written over its time), and
  `read_gbps`: a read-only pass (a float32 sum over 2 GiB of bf16): the card's physical limit is
  the larger of the two, and `fraction` is the kernel's bandwidth over it (target >= 0.70 at
  large batch);
- the torch path (`paged_decode_torch`: the pages gathered into a padded [B, C, Hkv, D], masked,
  SDPA) where its copies fit, with the largest difference between the two outputs.
Shapes whose cache is over --max-cache-gb are skipped. Results: results/paged_attention_<label>.json
(after every shape) and .png.

    python3 bench/gpu/paged_attention_bench.py --label h100-box          # bench/gpu_box.sh pagedattn
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fastdecode.rpart import paged_attention as pa  # noqa: E402
from fastdecode.rpart import paged_attention_triton as pat  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
HQ, HKV, D, PAGE = 32, 8, 128, 16                          # Llama-3-8B's attention, the tier's page
DEVICE = "cuda"


def timed_ms(fn, rounds: int, min_ms: float = 5.0) -> float:
    """Median over `rounds` of the mean time of one call, each round enough calls for min_ms."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    reps = max(1, min(200, math.ceil(min_ms / max(start.elapsed_time(stop), 1e-3))))
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    return statistics.median(times)


def copy_ms(rounds: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=DEVICE).normal_()     # 2 GiB
    dst = torch.empty_like(src)
    return timed_ms(lambda: dst.copy_(src), rounds)


def read_ms(rounds: int) -> float:
    buf = torch.empty(1 << 30, dtype=torch.bfloat16, device=DEVICE).normal_()     # 2 GiB
    return timed_ms(lambda: buf.sum(dtype=torch.float32), rounds)


def card_limits(rounds: int) -> dict:
    """The device-to-device copy and a read-only reduction, 2 GiB each: GB/s (1e9 bytes)."""
    limits = {"copy_gbps": round(2 * (2 << 30) / copy_ms(rounds) / 1e6, 1),
              "read_gbps": round((2 << 30) / read_ms(rounds) / 1e6, 1)}
    torch.cuda.empty_cache()
    return limits


def build(batch: int, context: int, seed: int = 0):
    """q [B, Hq, D]; caches [pages, PAGE, Hkv, D] bf16 with every row's pages in shuffled order."""
    pages_per_row = -(-context // PAGE)
    num_pages = batch * pages_per_row
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    k = torch.empty(num_pages, PAGE, HKV, D, dtype=torch.bfloat16, device=DEVICE).normal_(generator=g)
    v = torch.empty_like(k).normal_(generator=g)
    order = torch.randperm(num_pages, device=DEVICE, generator=g)
    block_tables = order.reshape(batch, pages_per_row).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=DEVICE).normal_(generator=g)
    return q, k, v, block_tables, seq_lens


def run_shape(batch: int, context: int, args, limit_gbps: float) -> dict:
    q, k, v, bt, lens = build(batch, context)
    scale = D ** -0.5
    read_bytes = 2 * batch * context * HKV * D * 2 + 2 * q.numel() * 2      # K + V, q + out
    out = torch.empty_like(q)
    os.environ[pa.ENV] = "triton"

    def kernel(splits=None):
        return pa.paged_decode_attention(q, k, v, bt, lens, scale, out=out, num_splits=splits)
    unit = max(pat.block_tokens(D, 2), PAGE)
    splits, _ = pat.plan_splits(batch, HKV, bt.shape[1] * PAGE, unit, pat.program_slots(q.device))
    ms = timed_ms(kernel, args.rounds)
    row = {"batch": batch, "context": context, "kv_gb": round(2 * k.numel() * 2 / 1e9, 2), "splits": splits,
           "kernel_ms": round(ms, 4), "kernel_gbps": round(read_bytes / ms / 1e6, 1),
           "fraction": round(read_bytes / ms / 1e6 / limit_gbps, 3)}
    if splits > 1:                                         # what the split plan buys
        one_ms = timed_ms(lambda: kernel(1), args.rounds)
        row["one_split_ms"] = round(one_ms, 4)
        row["one_split_gbps"] = round(read_bytes / one_ms / 1e6, 1)
    # the torch path gathers K and V (2x the cache), then SDPA may copy them once more
    if 3 * row["kv_gb"] <= args.torch_max_gb:
        expect = out.clone()
        try:
            torch_ms = timed_ms(lambda: pa.paged_decode_torch(q, k, v, bt, lens, scale), max(3, args.rounds // 2),
                                min_ms=0.0)
            got = pa.paged_decode_torch(q, k, v, bt, lens, scale)
            row.update(torch_ms=round(torch_ms, 3), torch_gbps=round(read_bytes / torch_ms / 1e6, 1),
                       speedup_vs_torch=round(torch_ms / ms, 2),
                       max_abs_diff_vs_torch=float((got.float() - expect.float()).abs().max()))
        except torch.OutOfMemoryError:
            row["torch"] = "out of memory"
    else:
        row["torch"] = f"skipped: its copies ({3 * row['kv_gb']:.0f} GB) over --torch-max-gb"
    return row


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"B={r['batch']}\nC={r['context']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.38
    bars = ax.bar([x - w / 2 for x in xs], [r["kernel_gbps"] for r in rows], w, label="Triton paged kernel")
    ax.bar_label(bars, labels=[f"{r['fraction']:.0%}" for r in rows], fontsize=7)
    ax.bar([x + w / 2 for x in xs], [r.get("torch_gbps", 0) for r in rows], w, label="torch: gather + SDPA")
    limits = result["limits"]
    ax.axhline(limits["copy_gbps"], color="k", lw=1, ls="--", label=f"device copy {limits['copy_gbps']:.0f} GB/s")
    ax.axhline(limits["read_gbps"], color="gray", lw=1, ls=":", label=f"read-only pass {limits['read_gbps']:.0f} GB/s")
    ax.axhline(0.7 * limits["limit_gbps"], color="r", lw=0.8, label="70% of the limit")
    ax.set_ylim(0, 1.35 * max(limits["limit_gbps"], *(r["kernel_gbps"] for r in rows)))
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("KV bytes read / time (GB/s)")
    ax.set_title(f"Paged decode attention, Llama-3-8B heads ({HQ}/{HKV} x {D}), bf16, pages of {PAGE}: "
                 f"{result['device']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 512, 4096])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 8192])
    ap.add_argument("--max-cache-gb", type=float, default=40.0, help="skip shapes whose K + V is larger")
    ap.add_argument("--torch-max-gb", type=float, default=60.0,
                    help="run the torch path where 3x the shape's K + V (its copies) is at most this")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("paged_attention_bench: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    import triton
    t0 = time.time()
    limits = card_limits(args.rounds)
    limits["limit_gbps"] = max(limits["copy_gbps"], limits["read_gbps"])
    print(limits, flush=True)
    result = {"label": args.label, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
              "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_tokens": PAGE, "dtype": "bfloat16"},
              "limits": limits, "rows": [], "skipped": []}
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"paged_attention_{args.label}")
    for batch in args.batches:
        for context in args.contexts:
            kv_gb = 2 * batch * context * HKV * D * 2 / 1e9
            if kv_gb > args.max_cache_gb:
                result["skipped"].append({"batch": batch, "context": context, "kv_gb": round(kv_gb, 1)})
                continue
            row = run_shape(batch, context, args, limits["limit_gbps"])
            torch.cuda.empty_cache()                               # the shape's cache is gone with run_shape
            print(row, flush=True)
            result["rows"].append(row)
            result["seconds"] = round(time.time() - t0, 1)
            with open(path + ".json", "w") as f:                  # after every shape: a cut run keeps them
                json.dump(result, f, indent=1)
    plot(result, path + ".png")
    print(f"{path}.json, .png ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
