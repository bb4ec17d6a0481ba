"""What the kernel benches share: where they live, the KV shapes they time, the data they fill a
store with, the timer, and the record a bf16 compute bench writes. Imported first by every script in bench/kernel/, because it also puts
this checkout (and tests/, for the float64 reference and the bf16 helpers) on sys.path, so a
script runs the packages next to it whatever else is installed.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
for _path in (os.path.join(REPO, "tests"), REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from kernel_ref import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

from rworker import KVStore  # noqa: E402

# name: (num_kv_heads, num_query_heads, head_dim, layers)
MODELS = {
    "smollm2-135m": (3, 9, 64, 30),
    "llama3-8b": (8, 32, 128, 32),
    "llama2-7b": (32, 32, 128, 32),
}


def best_time(fn, reps: int, min_time: float = 0.0) -> tuple[float, float]:
    """(best, median) seconds of fn() over >= reps calls after one warm-up (and >= min_time total);
    slow calls (torch SDPA on a small host) stop after 3 repetitions or 5 seconds."""
    fn()
    ts = []
    t_start = time.perf_counter()
    while len(ts) < reps or time.perf_counter() - t_start < min_time:
        if len(ts) >= 3 and time.perf_counter() - t_start > 5.0:
            break
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), float(np.median(ts))


def random_block(rng, rows: int, Hkv: int, D: int) -> np.ndarray:
    """[rows, Hkv, D] bf16 bits of N(0, 1) values (the S-worker ships bf16 as uint16)."""
    return f32_to_bf16_bits(rng.standard_normal((rows, Hkv, D), dtype=np.float32))


def fill_store(store: KVStore, blk: np.ndarray, B: int, ctx: int, kv_dtype: str) -> None:
    """Sequence b gets tokens blk[t % len(blk)] (K = V data: the values don't change the speed)."""
    src = blk if kv_dtype != "fp32" else bf16_bits_to_f32(blk)   # fp32 store: feed fp32
    nb = len(blk)
    for b in range(B):
        for t0 in range(0, ctx, nb):
            n = min(nb, ctx - t0)
            store.append(0, np.full(n, b, np.int64), src[:n], src[:n])


def dpbf16_record(label: str, threads: int, rounds: int, peak_rounds: list[float]) -> dict:
    """The head of a bf16 compute bench's result: the machine, its AVX-512/AMX features, torch, and
    the vdpbf16ps rate measured in the same run (GFLOP/s, each round's and their median)."""
    import torch

    from rworker import isa
    return {"label": label, "cpu": platform.processor() or platform.machine(),
            "features": sorted(f for f in isa.cpu_features() if f.startswith(("avx512", "amx"))),
            "threads": threads, "rounds": rounds, "torch": torch.__version__,
            "dpbf16_peak_gflops": round(statistics.median(peak_rounds), 1),
            "dpbf16_peak_rounds": [round(p, 1) for p in peak_rounds]}


def write_result(out: dict, name: str, plot) -> str:
    """results/<name>_<label>.json, and plot(out, its .png path); -> the JSON's path."""
    path = os.path.join(RESULTS, f"{name}_{out['label']}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    plot(out, path[:-5] + ".png")
    return path
