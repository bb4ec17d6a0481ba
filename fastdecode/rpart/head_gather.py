"""The R-workers seen from a tensor-parallel S-worker (`--tensor-parallel-size T`): each S-rank
computes q, k, v of its own heads, rank 0 gathers every rank's heads, hands the R-workers the
usual wire layout with all heads (over MPI, as at T = 1: the R-workers' protocol and kernels are
unchanged) and scatters the O they return back by heads.

    every S-rank:  q|k|v of its R-worker rows, its heads, in the wire layout of its heads ->
    rank 0:        gather [T, its buffer] -> per worker block: q [n_w, T, Hq/T, D] -> [n_w, Hq, D], k, v alike
                   -> the inner backend (MPIBackend, or local mode's store) -> O [n, Hq, D]
                   -> scatter O[:, r*Hq/T..] to rank r
    prefill:       K/V [n, Hkv/T, D] of every rank gathered into [n, Hkv, D] for the inner backend

`HeadGather` is rank 0's side (around the inner backend), `HeadFollower` the other ranks' (the
same collectives, in the same order: the runner calls both alike). A mini-batch without R-worker
rows skips the collectives on every rank (each knows the counts). Rows on the S-worker's own KV
tier never pass here: rpart/tiered.py hands them to each rank's own tier, which holds its heads.
"""
from __future__ import annotations

import torch

from fastdecode.rpart.base import PrefillTimes, RBackend, WorkerInfo


class _HeadExchange(RBackend):
    """What both sides share: this rank's head counts and the mini-batches' rows per worker."""

    def __init__(self, group, hq_local: int, hkv_local: int, d: int):
        self.group = group
        self.hq, self.hkv, self.d = hq_local, hkv_local, d       # this rank's heads
        self.prefill_times = PrefillTimes()
        self._counts: list[list[int]] = []                       # per mini-batch: rows per worker
        self._buffers: dict[int, torch.Tensor] = {}              # per mini-batch: this rank's q|k|v buffer
        self._pf_rows = 0

    def _begin(self, minibatches) -> None:
        self._counts = [[int(c) for c in counts] for _, counts in minibatches]

    def decode_buffer(self, layer, mb, numel, device, dtype):
        buf = self._buffers.get(mb)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[mb] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def _rows(self, mb: int) -> int:
        return sum(self._counts[mb])

    def _gather_kv(self, k: torch.Tensor, v: torch.Tensor):
        """k, v [n, Hkv/T, D] of this rank -> [2, n, Hkv, D] on rank 0 (None elsewhere)."""
        return self.group.gather_heads(torch.stack([k, v]))

    def _scatter_o(self, full: torch.Tensor | None, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.group.scatter_heads(full, n, self.hq, self.d, dtype)


class HeadGather(_HeadExchange):
    """Rank 0: the inner backend (every head) behind the gather and the scatter."""

    def __init__(self, inner: RBackend, group, hq_local: int, hkv_local: int, d: int):
        super().__init__(group, hq_local, hkv_local, d)
        self.inner = inner
        self.workers = inner.workers
        self._dtype = torch.float32

    @property
    def bytes_sent(self) -> int:
        return getattr(self.inner, "bytes_sent", 0)

    @property
    def bytes_received(self) -> int:
        return getattr(self.inner, "bytes_received", 0)

    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        self._pf_rows = int(sum(counts))
        self.inner.prefill_begin(row_ids, counts, layers, reserve, continued, forks)

    def prefill_layer(self, layer, k, v):
        if self._pf_rows:
            kv = self._gather_kv(k, v)                                      # [2, n, Hkv, D]
            self.inner.prefill_layer(layer, kv[0], kv[1])

    def prefill_end(self):
        self.inner.prefill_end()
        self.prefill_times = self.inner.prefill_times

    def decode_begin(self, minibatches, layers=0, mixed=None):
        self._begin(minibatches)
        self.inner.decode_begin(minibatches, layers, mixed)

    def decode_submit(self, layer, mb, packed):
        n = self._rows(mb)
        self._dtype = packed.dtype
        if not n:
            return self.inner.decode_submit(layer, mb, packed[:0])
        parts = self.group.gather(packed)                                   # [T, n * (Hq + 2 Hkv) D / T]
        full = self.inner.decode_buffer(layer, mb, parts.numel(), packed.device, packed.dtype)
        self._assemble(parts, self._counts[mb], full)
        self.inner.decode_submit(layer, mb, full)

    def _assemble(self, parts: torch.Tensor, counts: list[int], full: torch.Tensor) -> None:
        """Every rank's wire buffer of its heads (parts [T, elems]) -> the wire layout of all heads
        in `full`: per worker block, q, k and v each [n_w, T, heads of a rank, D]."""
        T, d = parts.shape[0], self.d
        local_row, at = (self.hq + 2 * self.hkv) * d, 0
        for n in counts:
            if not n:
                continue
            src = parts[:, at * local_row:(at + n) * local_row]               # [T, n * local_row]
            dst = full[at * local_row * T:(at + n) * local_row * T]
            offset = 0
            for heads in (self.hq, self.hkv, self.hkv):
                size = n * heads * d
                dst[offset * T:(offset + size) * T].view(n, T, heads * d).copy_(
                    src[:, offset:offset + size].view(T, n, heads * d).transpose(0, 1))
                offset += size
            at += n

    def decode_wait(self, layer, mb):
        full = self.inner.decode_wait(layer, mb)                            # [n, Hq, D]
        n = self._rows(mb)
        if not n:
            return full
        return self._scatter_o(full.to(self._dtype), n, self._dtype)       # [n, Hq/T, D]

    def decode_end(self):
        return self.inner.decode_end()

    def free(self, seq_ids_by_worker):
        self.inner.free(seq_ids_by_worker)

    def export_kv(self, seq_ids_by_worker):         # whole sequences, every head: the inner backend's
        return self.inner.export_kv(seq_ids_by_worker)

    def import_kv(self, worker, seq_ids, blobs):
        return self.inner.import_kv(worker, seq_ids, blobs)

    def profile_workers(self, seqs, target_bytes):
        return self.inner.profile_workers(seqs, target_bytes)

    def ping(self, sizes, repeats):
        return self.inner.ping(sizes, repeats)

    def ping_all(self, sizes, repeats):
        return self.inner.ping_all(sizes, repeats)

    def close(self):
        self.inner.close()


class HeadFollower(_HeadExchange):
    """Ranks 1..T-1: their heads go to rank 0 and come back; the R-workers are rank 0's (their
    infos as rank 0 sent them: placement's worker indices mean the same on every rank)."""

    def __init__(self, workers: list[WorkerInfo], group, hq_local: int, hkv_local: int, d: int, device: torch.device):
        super().__init__(group, hq_local, hkv_local, d)
        self.workers = workers
        self.device = device

    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        self._pf_rows = int(sum(counts))

    def prefill_layer(self, layer, k, v):
        if self._pf_rows:
            self._gather_kv(k, v)

    def prefill_end(self):
        pass

    def decode_begin(self, minibatches, layers=0, mixed=None):
        self._begin(minibatches)
        self._dtype = torch.float32

    def decode_submit(self, layer, mb, packed):
        self._dtype = packed.dtype
        if self._rows(mb):
            self.group.gather(packed)

    def decode_wait(self, layer, mb):
        n = self._rows(mb)
        if not n:
            return torch.empty((0, self.hq, self.d), dtype=self._dtype, device=self.device)
        return self._scatter_o(None, n, self._dtype)

    def decode_end(self):
        return None

    def free(self, seq_ids_by_worker):
        pass

    def export_kv(self, seq_ids_by_worker):
        raise _rank0_only()

    def import_kv(self, worker, seq_ids, blobs):
        raise _rank0_only()

    def profile_workers(self, seqs, target_bytes):
        return []

    def ping(self, sizes, repeats):
        return []

    def ping_all(self, sizes, repeats):
        return []

    def close(self):
        pass


def _rank0_only() -> RuntimeError:
    return RuntimeError("under tensor parallelism rank 0 alone moves KV blobs (the R-workers answer it, "
                        "whole sequences of every head); a follower S-rank has none to give or take")
