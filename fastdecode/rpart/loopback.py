"""A backend with the S-worker's transport work but no R-part: for measuring the S-worker alone.

It packs Q/K/V (and prompt K/V) into host buffers exactly as the MPI transport does (device->host
on the side stream on CUDA) and hands back O from a host buffer (host->device), but runs no
attention and sends nothing. bench/s_overhead_bench.py times the engine's real decode step
through it (RoPE, packing, staging, Python per mini-batch: everything the S-worker does per
layer) against the pure dense GEMMs.
"""
from __future__ import annotations

import torch

from .base import RBackend, StepStats, WorkerInfo
from .staging import HostBuffer, Stager


class LoopbackBackend(RBackend):
    def __init__(self, num_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype):
        self.workers = [WorkerInfo(rank=1, host="loopback", threads=0, isa="none", capacity_bytes=1 << 50)]
        self.hq, self.d = num_heads, head_dim
        self.dtype, self.pinned = dtype, device.type == "cuda"
        self.stager = Stager(device)
        self.slots: dict[int, dict] = {}
        self.n: dict[int, int] = {}
        self.prefill_buf = HostBuffer(dtype, self.pinned)

    # prefill: the prompt K/V are staged to host as the MPI transport would send them
    def prefill_begin(self, row_ids, counts):
        pass

    def prefill_layer(self, layer, k, v):
        self.stager.wait(self.stager.to_host([k, v], self.prefill_buf))

    def prefill_end(self):
        pass

    def decode_begin(self, minibatches):
        self.n = {mb: len(ids) for mb, (ids, _) in enumerate(minibatches)}
        for mb, n in self.n.items():
            if mb not in self.slots:
                self.slots[mb] = {"send": HostBuffer(self.dtype, self.pinned),
                                  "out": [HostBuffer(self.dtype, self.pinned), HostBuffer(self.dtype, self.pinned)],
                                  "ready": None}
            for buf in self.slots[mb]["out"]:      # [n, Hq, D] replies, filled once with finite values
                if buf.tensor.numel() < n * self.hq * self.d:
                    buf.ensure(n * self.hq * self.d)
                    buf.tensor.normal_()

    def decode_submit(self, layer, mb, q, k, v):
        slot = self.slots[mb]
        slot["ready"] = self.stager.to_host([q, k, v], slot["send"])

    def decode_wait(self, layer, mb):
        slot = self.slots[mb]
        self.stager.wait(slot["ready"])           # a reply cannot come before the rows left
        n = self.n[mb]
        host = slot["out"][layer % 2].tensor[: n * self.hq * self.d].view(n, self.hq, self.d)
        return self.stager.to_device(host)

    def decode_end(self):
        return StepStats()

    def free(self, seq_ids_by_worker):
        pass
