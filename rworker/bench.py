"""Micro-benchmarks an R-worker runs for `fastdecode profile` (numpy only, no torch).

The attention cost model is t(call) = overhead + bytes / bandwidth, fitted from two contexts
with the same number of sequences, each timed as the median of several calls.
"""
from __future__ import annotations

import os
import subprocess
import time

import numpy as np

from rworker.kvstore import KVStore
from rworker.protocol.kvformat import kv_token_bytes


def largest_cache_bytes() -> int:
    """Largest CPU cache (sysfs), 0 if unknown: a timed KV working set must not fit in it."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in os.listdir(base):
            if not idx.startswith("index"):
                continue
            with open(os.path.join(base, idx, "size")) as f:
                txt = f.read().strip()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(txt[-1], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    try:  # a VM may show one slice in sysfs while sharing a larger host cache (cpuid via glibc)
        out = subprocess.run(["getconf", "LEVEL3_CACHE_SIZE"], capture_output=True, text=True, timeout=5).stdout
        best = max(best, int(out.strip() or 0))
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return best


def default_target_bytes() -> int:
    """KV bytes of the long timing: 3x the largest cache, at least 256 MiB, so it streams from DRAM
    as a decode step over every layer's KV does (a smaller set runs partly from cache and
    overstates the bandwidth)."""
    return max(256 << 20, 3 * largest_cache_bytes())


def _median_time(fn, repeats: int) -> float:
    fn()                                     # warm caches, threads and pages
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure_attention(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str, threads: int | None,
                      seqs: int = 64, target_bytes: int = 0, repeats: int = 5, seed: int = 0,
                      v_tile: int | None = None, prefetch: bool | str | None = None) -> dict:
    """Seconds per KV byte and fixed seconds per call of `attend` on this machine
    (target_bytes 0: default_target_bytes()), with the kernel choice the worker's store runs
    (v_tile, prefetch: rworker.tune)."""
    rng = np.random.default_rng(seed)
    target_bytes = target_bytes or default_target_bytes()
    token_bytes = kv_token_bytes(kv_dtype, num_kv_heads, head_dim)              # K and V of one token, one layer
    long_len = max(64, int(target_bytes // (seqs * token_bytes)))
    points = []
    for length in (32, long_len):
        store = KVStore(1, num_kv_heads, head_dim, kv_dtype=kv_dtype, threads=threads, v_tile=v_tile,
                        prefetch=prefetch)
        ids = np.repeat(np.arange(seqs, dtype=np.int64), length)
        chunk = 1 << 16                                                    # append in bounded slabs
        for s in range(0, ids.size, chunk):
            n = min(chunk, ids.size - s)
            kv = rng.standard_normal((2, n, num_kv_heads, head_dim), dtype=np.float32)
            store.append(0, ids[s:s + n], kv[0], kv[1])
        q = rng.standard_normal((seqs, num_heads, head_dim), dtype=np.float32)
        out = np.empty_like(q)
        uniq = np.arange(seqs, dtype=np.int64)
        t = _median_time(lambda: store.attend(0, uniq, q, out=out), repeats)
        points.append((seqs * length * token_bytes, t))
        threads_used = store.threads
        del store
    (b1, t1), (b2, t2) = points
    per_byte = max((t2 - t1) / (b2 - b1), 1e-15)
    return {"seconds_per_kv_byte": per_byte, "call_overhead_s": max(t1 - per_byte * b1, 0.0),
            "bandwidth_GBps": 1e-9 / per_byte, "threads": threads_used, "samples": points}
