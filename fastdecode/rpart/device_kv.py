"""The device KV tier: sequences whose KV lives in the S-worker's own memory, attended in-process.

On a GPU S-worker this is the card's HBM: 20x a socket's bandwidth and no hand-off. A prefill
writes the prompt's K/V straight into the tier's pages, and per layer a decode mini-batch's rows
append their new K/V and attend with the paged decode kernel (rpart/paged_attention.py), queued
on the compute stream between the S-part's kernels: no copy leaves the device. It is one more
RBackend with one worker, so placement treats it as a worker (rpart/tiered.py puts it beside
the R-workers); on a CPU S-worker the tier is the in-process AVX-512 store instead
(rpart/local.py), which is faster on CPUs than this torch code.

    cache: K and V each [L, pages, page_tokens, Hkv, D] in the KV dtype (bf16, fp16 or fp32)
    pool:  per sequence its page ids (shared by every layer) and length (rpart/page_pool.py)
"""
from __future__ import annotations

import socket
import time

import numpy as np
import torch

from fastdecode.model.config import ModelConfig
from fastdecode.rpart.base import PrefillTimes, RBackend, StepStats, WorkerInfo
from fastdecode.rpart.page_pool import PagePool
from fastdecode.rpart.paged_attention import backend_for, paged_decode_attention, write_kv
from fastdecode.rpart.variants import AttentionVariants
from rworker.protocol.wire import split_qkv

PAGE_TOKENS = 32                        # the R-workers' page (csrc Store::P): prefix forks share whole pages alike
TIER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def page_bytes(config: ModelConfig, kv_dtype: str, page_tokens: int = PAGE_TOKENS) -> int:
    """Bytes of one page: page_tokens tokens of K and V in every layer."""
    return 2 * config.num_layers * page_tokens * config.num_kv_heads * config.head_dim \
        * torch.finfo(TIER_DTYPES[kv_dtype]).bits // 8


class _Step:
    """One mini-batch's rows on the tier this step: where their new K/V go and what they read."""

    def __init__(self, ids: np.ndarray, slots: torch.Tensor, table: torch.Tensor, lens: torch.Tensor):
        self.ids = ids              # [n] seq ids
        self.slots = slots          # [n] int64 flat slot of each row's new token
        self.table = table          # [n, max pages] int32
        self.lens = lens            # [n] int32 keys each row attends (its new token included)
        self.out: torch.Tensor | None = None


class DeviceKVTier(RBackend):
    def __init__(self, config: ModelConfig, kv_dtype: str, capacity_bytes: int, device: torch.device,
                 variants: AttentionVariants | None = None, page_tokens: int = PAGE_TOKENS):
        if kv_dtype not in TIER_DTYPES:
            raise ValueError(f"the device KV tier stores {', '.join(TIER_DTYPES)}, not {kv_dtype} KV")
        c = config
        self.num_layers, self.hq, self.hkv, self.d = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
        self.device, self.kv_dtype = device, kv_dtype
        self.dtype = TIER_DTYPES[kv_dtype]
        self.variants = variants or AttentionVariants.of(config)
        self.windows = list(self.variants.windows) or [0] * self.num_layers                  # [L]
        sinks = self.variants.sink_rows(self.num_layers, self.hq)                             # [L, Hq] or None
        self.sinks = torch.from_numpy(sinks).to(device) if sinks is not None else None
        self.page_bytes = page_bytes(config, kv_dtype, page_tokens)
        pages = max(int(capacity_bytes) // self.page_bytes, 0)
        self.pool = PagePool(pages, page_tokens)
        shape = (self.num_layers, pages, page_tokens, self.hkv, self.d)
        # zeroed once: a page's slots past a sequence's length are read (masked) by whole-page paths,
        # and uninitialized memory may hold NaNs, which a zero weight does not cancel
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=device)       # [L, pages, P, Hkv, D]
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=device)
        self.cuda = device.type == "cuda"
        self.workers = [WorkerInfo(rank=0, host=socket.gethostname(), threads=0, isa=device.type,
                                   capacity_bytes=pages * self.page_bytes, page_tokens=page_tokens,
                                   kernel=f"paged decode attention, {self._kernel_path()}", forks=not self.variants.windowed,
                                   tier=f"device ({device})", frees_windows=False)]
        self.prefill_times = PrefillTimes()
        self._pf_slots: torch.Tensor | None = None
        self._steps: list[_Step] = []
        self._timers: list[tuple] = []       # (start, end) events (CUDA) or seconds (CPU) of this step's attention

    def _kernel_path(self) -> str:
        probe = torch.empty(0, self.hq, self.d, dtype=self.dtype, device=self.device)
        return backend_for(probe, self.d)

    # ------------------------------------------------------------------ prefill: K/V straight into the pages

    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        self.prefill_times = PrefillTimes()
        for dst, src, tokens in zip(*forks[:3]) if forks is not None else ():
            self.pool.fork(int(src), int(dst), int(tokens))
        slots = np.empty(len(row_ids), dtype=np.int64)                            # [rows]
        starts = np.flatnonzero(np.r_[True, row_ids[1:] != row_ids[:-1]]) if len(row_ids) else []
        ends = list(starts[1:]) + [len(row_ids)]
        for s, e in zip(starts, ends):                                            # a prompt's rows are consecutive
            slots[s:e] = self.pool.extend(int(row_ids[s]), e - s)
        self._pf_slots = torch.from_numpy(slots).to(self.device, non_blocking=True)

    def prefill_layer(self, layer, k, v):
        t = time.perf_counter()
        write_kv(self.k_cache[layer], self.v_cache[layer], self._pf_slots, k.to(self.dtype), v.to(self.dtype))
        self.prefill_times.pack_s += time.perf_counter() - t

    def prefill_end(self):
        self._pf_slots = None

    # ------------------------------------------------------------------ decode: append and attend per layer

    def decode_begin(self, minibatches, layers=0, mixed=None):
        self._steps, self._timers = [], []
        for ids, _ in minibatches:
            slots = np.concatenate([self.pool.extend(int(s), 1) for s in ids]) if len(ids) else np.zeros(0, np.int64)
            up = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)    # noqa: E731
            self._steps.append(_Step(ids, up(slots), up(self.pool.block_table(ids)), up(self.pool.lengths(ids))))

    def decode_buffer(self, layer, mb, numel, device, dtype):
        return torch.empty(numel, dtype=dtype, device=device)

    def _clock(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def decode_submit(self, layer, mb, packed):
        st = self._steps[mb]
        n = len(st.ids)
        if n == 0:
            st.out = torch.empty(0, self.hq, self.d, dtype=packed.dtype, device=packed.device)
            return
        t0 = self._clock()
        q, k, v = split_qkv(packed, n, self.hq, self.hkv, self.d)       # [n, Hq, D], [n, Hkv, D] x 2
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        write_kv(kc, vc, st.slots, k.to(self.dtype), v.to(self.dtype))
        if kc.dtype not in (q.dtype, torch.float32):      # a float32 S-part over a 16-bit tier (a CPU's)
            q = q.to(kc.dtype)
        st.out = paged_decode_attention(q, kc, vc, st.table, st.lens, self.variants.scale,
                                        window=self.windows[layer], softcap=self.variants.softcap,
                                        sinks=None if self.sinks is None else self.sinks[layer]
                                        ).to(packed.dtype)                                         # [n, Hq, D]
        self._timers.append((t0, self._clock()))

    def decode_wait(self, layer, mb):
        out, self._steps[mb].out = self._steps[mb].out, None
        return out

    def attend_seconds(self) -> float:
        """The step's attention time so far (on CUDA: read once the step's tokens came back)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self._timers) / 1e3
        return sum(b - a for a, b in self._timers)

    def decode_end(self):
        attend = self.attend_seconds()
        self._steps, self._timers = [], []
        saved = (self.pool.page_reads - self.pool.pages_in_use) * self.page_bytes
        return StepStats(attend_s=[attend], busy_s=[attend], kv_bytes=[self.pool.pages_in_use * self.page_bytes],
                         append_s=[0.0], kv_saved_bytes=[saved])

    def free(self, seq_ids_by_worker):
        for sid in seq_ids_by_worker[0]:
            self.pool.free(int(sid))

    # ------------------------------------------------------------------ profiling

    def profile_workers(self, seqs: int, target_bytes: int) -> list[dict]:
        """The kernel's seconds per KV byte (one layer's K and V) and fixed cost per call, timed on
        the tier's own (empty) pages: a short and a long context, as an R-worker measures."""
        token_bytes = 2 * self.hkv * self.d * torch.finfo(self.dtype).bits // 8          # one layer
        room = self.pool.num_pages - self.pool.pages_in_use
        seqs = max(1, min(seqs, room // 2))
        per_seq = room // seqs * self.pool.page_tokens            # tokens each probe sequence may take
        short = min(32, max(per_seq // 4, 1))
        long_len = max(short + 1, min(max(64, int(target_bytes // (seqs * token_bytes))), per_seq))
        if room < 2 or long_len > per_seq:
            raise ValueError(f"the device KV tier ({room} free pages) is too small to time its kernel")
        points = []
        gen = torch.Generator(device=self.device).manual_seed(0)
        for length in (short, long_len):
            ids = np.arange(-seqs, 0, dtype=np.int64) - 1         # never a real sequence's id
            slots = np.concatenate([self.pool.extend(int(s), length) for s in ids])
            try:
                s = torch.from_numpy(slots).to(self.device)
                kv = torch.randn((len(slots), self.hkv, self.d), generator=gen, device=self.device).to(self.dtype)
                write_kv(self.k_cache[0], self.v_cache[0], s, kv, kv)
                q = torch.randn((seqs, self.hq, self.d), generator=gen, device=self.device).to(self.dtype)
                table = torch.from_numpy(self.pool.block_table(ids)).to(self.device)
                lens = torch.from_numpy(self.pool.lengths(ids)).to(self.device)
                points.append((seqs * length * token_bytes, self._time(q, table, lens)))
            finally:
                for sid in ids:
                    self.pool.free(int(sid))
        (b1, t1), (b2, t2) = points
        per_byte = max((t2 - t1) / max(b2 - b1, 1), 1e-15)
        w = self.workers[0]
        return [{"seconds_per_kv_byte": per_byte, "call_overhead_s": max(t1 - per_byte * b1, 0.0),
                 "bandwidth_GBps": 1e-9 / per_byte, "threads": 0, "samples": points, "rank": w.rank,
                 "host": w.host, "capacity_bytes": w.capacity_bytes, "tier": w.tier}]

    def _time(self, q, table, lens, repeats: int = 5) -> float:
        kc, vc = self.k_cache[0], self.v_cache[0]
        run = lambda: paged_decode_attention(q, kc, vc, table, lens, self.variants.scale)   # noqa: E731
        run()
        times = []
        for _ in range(repeats):
            if self.cuda:
                torch.cuda.synchronize(self.device)
            t = time.perf_counter()
            run()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    def ping(self, sizes: list[int], repeats: int) -> list[list[float]]:
        return [[0.0] * len(sizes)]          # in-process: nothing crosses a link

    def ping_all(self, sizes: list[int], repeats: int) -> list[float]:
        return [0.0] * len(sizes)

    def close(self):
        self.k_cache = self.v_cache = None
