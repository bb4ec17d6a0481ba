"""Local mode: the R-part runs in-process on the same KV store and kernel an R-worker uses."""
from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from fastdecode.model.config import ModelConfig
from fastdecode.rpart.base import (KVImportError, PrefillTimes, RBackend, StepStats, WorkerInfo, as_numpy,
                                   check_kv_import, check_kv_lists)
from fastdecode.rpart.staging import HostBuffer, Stager, numpy_view
from fastdecode.rpart.variants import AttentionVariants
from rworker.host.capacity import default_capacity_bytes
from rworker.kv_blobs import import_one, layout_hex
from rworker.protocol.wire import split_qkv
from rworker.tune import open_tuned_store


class LocalBackend(RBackend):
    def __init__(self, config: ModelConfig, kv_dtype: str, threads: int | None = None,
                 capacity_bytes: int | None = None, asynchronous: bool = False, bf16_probs: bool = False,
                 variants: AttentionVariants | None = None):
        capacity = capacity_bytes or default_capacity_bytes()
        variants = variants or AttentionVariants.of(config)
        # the V layout and prefetch that stream fastest here, as an R-worker picks them (rworker.tune)
        self.store, kernel = open_tuned_store(config.num_layers, config.num_heads, config.num_kv_heads,
                                              config.head_dim, kv_dtype, threads, capacity, bf16_probs=bf16_probs,
                                              **variants.store_kwargs(config.num_layers, config.num_heads))
        self.workers = [WorkerInfo(rank=0, host=socket.gethostname(), threads=self.store.threads,
                                   isa=self.store.isa, capacity_bytes=capacity,
                                   page_tokens=getattr(self.store, "page_tokens", 1), kernel=kernel.describe(),
                                   forks=hasattr(self.store, "fork") and not variants.windowed,
                                   kv_layout=layout_hex(self.store))]
        self.num_heads = config.num_heads
        self._row_ids = None
        self._mb_ids: list[np.ndarray] = []
        self._out: dict = {}
        self._attend_s = 0.0
        self.prefill_times = PrefillTimes()
        self._appends: list = []        # this prefill's appends queued on the helper thread
        # with a pipeline the kernel runs on a helper thread (it releases the GIL) while this
        # thread computes the next mini-batch's S-part; one thread keeps calls in order
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rpart") if asynchronous else None
        # a GPU S-worker's rows reach this store through pinned buffers on the copy streams
        # (rpart/staging.py), never a synchronous copy per layer; made at the first CUDA tensor
        self._stager = Stager(torch.device("cpu"))
        self._pf_host: list[HostBuffer | None] = [None, None]
        self._pf_busy: list = [None, None]
        self._dec_host: dict[int, HostBuffer] = {}

    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        self._row_ids = row_ids
        self.prefill_times = PrefillTimes()
        for dst, src, tokens in zip(*forks[:3]) if forks is not None else ():
            self.store.fork(int(src), int(dst), int(tokens))     # before the reservations, as an R-worker
        if reserve is not None and len(reserve[0]):
            self.store.reserve(reserve[0], reserve[1])

    def _cuda_stager(self, device: torch.device) -> Stager:
        if not self._stager.cuda:
            self._stager = Stager(device)
        return self._stager

    def _append(self, layer, row_ids, k, v, ready=None, slot=None):
        t = time.perf_counter()
        self._stager.wait(ready)
        self.store.append(layer, row_ids, k, v)
        self.prefill_times.append_s += time.perf_counter() - t

    def prefill_layer(self, layer, k, v):
        t = time.perf_counter()
        if self._pool and k.is_cuda:     # off the card on the copy stream; the helper thread waits for it
            args = self._staged_kv(layer, k, v)
        else:
            args = (layer, self._row_ids, as_numpy(k), as_numpy(v))
        self.prefill_times.pack_s += time.perf_counter() - t
        if self._pool:      # the helper thread appends layer i while this one computes layer i + 1
            future = self._pool.submit(self._append, *args)
            self._appends.append(future)
            if len(args) == 6:
                self._pf_busy[args[5]] = future
        else:
            self._append(*args)

    def _staged_kv(self, layer, k, v):
        """A GPU S-worker's prompt K/V [n, Hkv, D] x 2 into a pinned buffer by an async copy (two
        buffers by layer parity: the one two layers back is free once that layer's append ran)
        -> the append's arguments, the copy's event first in line."""
        slot = layer % 2
        if self._pf_busy[slot] is not None:
            t = time.perf_counter()
            self._pf_busy[slot].result()
            self.prefill_times.wait_s += time.perf_counter() - t
        n = k.shape[0]
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])                       # [2 n Hkv D] on the device
        if self._pf_host[slot] is None or self._pf_host[slot].dtype != packed.dtype:
            self._pf_host[slot] = HostBuffer(packed.dtype, True)
        ready = self._cuda_stager(packed.device).to_host(packed, self._pf_host[slot])
        host = numpy_view(self._pf_host[slot].tensor[: packed.numel()])
        half = packed.numel() // 2
        return (layer, self._row_ids, host[:half].reshape(n, *k.shape[1:]), host[half:].reshape(n, *k.shape[1:]),
                ready, slot)

    def prefill_end(self):
        t = time.perf_counter()
        for f in self._appends:
            f.result()
        self._appends = []
        self._pf_busy = [None, None]
        self.prefill_times.wait_s += time.perf_counter() - t
        self._row_ids = None

    def decode_begin(self, minibatches, layers=0, mixed=None):
        self._mb_ids = [ids for ids, _ in minibatches]
        self._attend_s = 0.0

    def _attend(self, layer, ids, q, k, v, ready=None):
        self._stager.wait(ready)
        t = time.perf_counter()
        o = self.store.append_attend(layer, ids, q, k, v)
        self._attend_s += time.perf_counter() - t
        return o

    def decode_buffer(self, layer, mb, numel, device, dtype):
        return torch.empty(numel, dtype=dtype, device=device)

    def decode_submit(self, layer, mb, packed):
        device = packed.device
        ids = self._mb_ids[mb]
        ready = None
        if self._pool and packed.is_cuda:       # off the card on the copy stream, awaited on the helper thread
            host = self._dec_host.get(mb)
            if host is None or host.dtype != packed.dtype:
                host = self._dec_host[mb] = HostBuffer(packed.dtype, True)
            ready = self._cuda_stager(packed.device).to_host(packed, host)
            packed = host.tensor[: packed.numel()]
        q, k, v = split_qkv(packed.cpu(), len(ids), self.num_heads, self.store.num_kv_heads,
                            self.store.head_dim)            # one worker: q | k | v of all rows
        args = (layer, ids, as_numpy(q), as_numpy(k), as_numpy(v), ready)
        self._out[mb] = (self._pool.submit(self._attend, *args) if self._pool else self._attend(*args), device)

    def decode_wait(self, layer, mb):
        o, device = self._out.pop(mb)
        if self._pool:
            o = o.result()
        if device.type == "cuda":
            return self._cuda_stager(device).to_device(torch.from_numpy(o))[0]   # H2D on its side stream
        return torch.from_numpy(o).to(device)

    def decode_end(self):
        return StepStats(attend_s=[self._attend_s], busy_s=[self._attend_s], kv_bytes=[self.store.bytes_committed()],
                         kv_saved_bytes=[self.store.sharing_stats()["bytes_saved"]])

    def free(self, seq_ids_by_worker):
        for sid in seq_ids_by_worker[0]:
            self.store.free(int(sid))

    def export_kv(self, seq_ids_by_worker):
        check_kv_lists(self, seq_ids_by_worker)
        return [{int(s): self.store.export_seq(int(s)) for s in seq_ids_by_worker[0]}]

    def import_kv(self, worker, seq_ids, blobs):
        """Each blob into the store as an R-worker takes it (rworker.kv_blobs.import_one)."""
        check_kv_import(self, worker, seq_ids, blobs)
        stored, refused = [], []
        for sid, blob in zip(seq_ids, blobs):
            ok, why = import_one(self.store, int(sid), blob)
            stored.append(ok)
            if why:
                refused.append([int(sid), why])
        if refused:
            raise KVImportError.of(self.workers[0].rank, "the in-process store (rank 0)", refused, stored)
        return stored

    def profile_workers(self, seqs: int, target_bytes: int) -> list[dict]:
        from rworker.bench import measure_attention
        s = self.store
        result = measure_attention(self.num_heads, s.num_kv_heads, s.head_dim, s.kv_dtype, s.threads,
                                   seqs=seqs, target_bytes=target_bytes, v_tile=s.v_tile, prefetch=s.prefetch,
                                   amx=s.amx)
        result.update(rank=0, host=self.workers[0].host, capacity_bytes=self.workers[0].capacity_bytes)
        return [result]

    def ping(self, sizes: list[int], repeats: int) -> list[list[float]]:
        return [[0.0] * len(sizes)]      # in-process: the R-part reads the S-part's arrays directly

    def ping_all(self, sizes: list[int], repeats: int) -> list[float]:
        return [0.0] * len(sizes)

    def close(self):
        if self._pool:
            self._pool.shutdown()
