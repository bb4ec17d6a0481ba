"""Micro-benchmarks an R-worker runs for `fastdecode profile` (numpy only, no torch).

The attention cost model is t(call) = overhead + bytes / bandwidth, fitted from two contexts
with the same number of sequences, each timed as the median of several calls. A third timing
prices a shared prefix (KVStore.fork): the kernel reads its pages once per group, but every
member's query heads still run over them, so a member-token of shared prefix costs a fraction
of a streamed token (shared_cost_ratio; docs/design.md, "The sizing model").
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
                      v_tile: int | None = None, prefetch: bool | str | None = None, amx: str | None = None) -> dict:
    """Seconds per KV byte and fixed seconds per call of `attend` on this machine
    (target_bytes 0: default_target_bytes()), with the kernel choice the worker's store runs
    (v_tile, prefetch, amx: rworker.tune; amx None: FASTDECODE_AMX decides, as for any store). Where the store can fork (shared prefixes) and `seqs` >= 2,
    also the shared prefix's cost (measure_shared_attention's keys): the callers (the worker's
    profile reply, the local backend) pass this dict on whole, so old stores simply lack them."""
    rng = np.random.default_rng(seed)
    target_bytes = target_bytes or default_target_bytes()
    token_bytes = kv_token_bytes(kv_dtype, num_kv_heads, head_dim)              # K and V of one token, one layer
    long_len = max(64, int(target_bytes // (seqs * token_bytes)))
    points = []
    for length in (32, long_len):
        store = KVStore(1, num_kv_heads, head_dim, kv_dtype=kv_dtype, threads=threads, v_tile=v_tile,
                        prefetch=prefetch, amx=amx)
        _append_random(store, rng, np.repeat(np.arange(seqs, dtype=np.int64), length))
        t = _time_attend(store, rng, np.arange(seqs, dtype=np.int64), num_heads, repeats)
        points.append((seqs * length * token_bytes, t))
        threads_used = store.threads
        del store
    (b1, t1), (b2, t2) = points
    per_byte = max((t2 - t1) / (b2 - b1), 1e-15)
    result = {"seconds_per_kv_byte": per_byte, "call_overhead_s": max(t1 - per_byte * b1, 0.0),
              "bandwidth_GBps": 1e-9 / per_byte, "threads": threads_used, "samples": points}
    if hasattr(KVStore, "fork") and seqs >= 2:
        result.update(measure_shared_attention(
            num_heads, num_kv_heads, head_dim, kv_dtype, threads, seqs, min(SHARED_PREFIX_TOKENS, long_len),
            per_byte, result["call_overhead_s"], repeats, rng, v_tile, prefetch, amx))
    return result


SHARED_PREFIX_TOKENS = 1024     # the shared-prefix timing's prefix at most: a system prompt's length


def measure_shared_attention(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                             threads: int | None, members: int, prefix_tokens: int, seconds_per_kv_byte: float,
                             call_overhead_s: float, repeats: int, rng: np.random.Generator,
                             v_tile: int | None = None, prefetch: bool | str | None = None, amx: str | None = None) -> dict:
    """What a member-token of shared prefix costs against a streamed (unshared) KV token.

    One donor holds `prefix_tokens` (whole pages), `members` sequences fork it and add one page
    of their own, and one attend call covers the members; a second store holds the members' own
    pages alone (the same tokens), timed the same way. The sizing model prices the difference as
    the prefix streamed once for the group plus (members - 1) x prefix member-tokens at
    shared_cost_ratio of a streamed token (the further members' heads over pages in cache), so

        seconds per member-byte = (t - t_own - prefix x token bytes x s/byte)
                                  / ((members - 1) x prefix x token bytes),

    and the ratio is that over s/byte, clamped to [0.01, 1]. (Pricing the members' own pages at
    the streamed rate instead, as the model's R term does for long contexts, overstated them:
    32-token runs per sequence stream slower than long ones, and the shared part came out ~1.4x
    too cheap.)"""
    store = KVStore(1, num_kv_heads, head_dim, kv_dtype=kv_dtype, threads=threads, v_tile=v_tile,
                    prefetch=prefetch, amx=amx)
    own = KVStore(1, num_kv_heads, head_dim, kv_dtype=kv_dtype, threads=threads, v_tile=v_tile,
                  prefetch=prefetch, amx=amx)
    page = max(int(store.page_tokens), 1)
    prefix = max(page, prefix_tokens // page * page)
    donor = members
    _append_random(store, rng, np.full(prefix, donor, dtype=np.int64))
    for m in range(members):
        store.fork(donor, m, prefix)
    ids = np.arange(members, dtype=np.int64)
    _append_random(store, rng, np.repeat(ids, page))
    _append_random(own, rng, np.repeat(ids, page))
    t = _time_attend(store, rng, ids, num_heads, repeats)
    t_own = _time_attend(own, rng, ids, num_heads, repeats)
    del store, own
    token_bytes = kv_token_bytes(kv_dtype, num_kv_heads, head_dim)
    shared_s = t - t_own - prefix * token_bytes * seconds_per_kv_byte
    per_byte = max(shared_s, 0.0) / ((members - 1) * prefix * token_bytes)
    ratio = min(max(per_byte / seconds_per_kv_byte, 0.01), 1.0)
    # the absolute cost too: the shared part is compute-bound, so it holds still where the read (and
    # with it the ratio) swings between runs
    return {"shared_cost_ratio": ratio, "shared_seconds_per_kv_byte": per_byte, "shared_prefix_tokens": prefix,
            "shared_members": members, "shared_call_s": t, "shared_own_call_s": t_own}


def _append_random(store: KVStore, rng: np.random.Generator, ids: np.ndarray) -> None:
    """Random K, V at layer 0 for each entry of `ids` (one token each), in bounded slabs."""
    chunk = 1 << 16
    for s in range(0, ids.size, chunk):
        n = min(chunk, ids.size - s)
        kv = rng.standard_normal((2, n, store.num_kv_heads, store.head_dim), dtype=np.float32)
        store.append(0, ids[s:s + n], kv[0], kv[1])


def _time_attend(store: KVStore, rng: np.random.Generator, ids: np.ndarray, num_heads: int, repeats: int) -> float:
    """Median seconds of one attend call over `ids` at layer 0 (after a warm-up)."""
    q = rng.standard_normal((ids.size, num_heads, store.head_dim), dtype=np.float32)
    out = np.empty_like(q)
    return _median_time(lambda: store.attend(0, ids, q, out=out), repeats)
