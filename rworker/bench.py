"""Micro-benchmarks an R-worker runs for `fastdecode profile` (numpy only, no torch).

The attention cost model is t(call) = overhead + bytes / bandwidth, fitted from two contexts
with the same number of sequences, each timed as the median of several calls.
"""
from __future__ import annotations

import time

import numpy as np

from .kvstore import KVStore

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def _median_time(fn, repeats: int) -> float:
    fn()                                     # warm caches, threads and pages
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure_attention(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str, threads: int | None,
                      seqs: int = 64, target_bytes: int = 256 << 20, repeats: int = 5, seed: int = 0) -> dict:
    """Seconds per KV byte and fixed seconds per call of `attend` on this machine."""
    rng = np.random.default_rng(seed)
    token_bytes = 2 * num_kv_heads * head_dim * ITEMSIZE[kv_dtype]          # K and V of one token, one layer
    long_len = max(64, int(target_bytes // (seqs * token_bytes)))
    points = []
    for length in (32, long_len):
        store = KVStore(1, num_kv_heads, head_dim, kv_dtype=kv_dtype, threads=threads)
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
