"""A backend with the S-worker's transport work but no R-part: for measuring the S-worker alone.

It moves Q/K/V to host buffers exactly as the MPI transport does (device->host on the D2H side
stream on CUDA) and hands back O from a host buffer (host->device on the H2D side stream), but
runs no attention and sends nothing: a mini-batch's output is "back" as soon as its rows reached
host memory. bench/gpu/s_overhead_bench.py times the engine's real decode step through it (RoPE,
packing, staging, Python per mini-batch: everything the S-worker does per layer) against the
pure dense GEMMs. With transfers=False it moves nothing at all: the S-part's own compute, which
`fastdecode profile` tables as T_S(B) on a GPU (the copies belong to the link: docs/design.md, "The sizing model").
"""
from __future__ import annotations

import torch

from fastdecode.rpart.base import PrefillTimes, RBackend, StepStats, WorkerInfo
from fastdecode.rpart.staging import HostBuffer, Stager


class LoopbackBackend(RBackend):
    def __init__(self, num_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                 transfers: bool = True):
        self.transfers = transfers          # False: no copies at all (the S-part's compute alone)
        self.device = device
        self.workers = [WorkerInfo(rank=1, host="loopback", threads=0, isa="none", capacity_bytes=1 << 50)]
        self.hq, self.d = num_heads, head_dim
        self.dtype, self.pinned = dtype, device.type == "cuda"
        self.stager = Stager(device)
        self.slots: dict[int, dict] = {}
        self.n: dict[int, int] = {}
        self.prefill_buf = HostBuffer(dtype, self.pinned)
        self.prefill_times = PrefillTimes()

    # prefill: the prompt K/V are staged to host as the MPI transport would send them
    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        pass

    def prefill_layer(self, layer, k, v):
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])
        self.stager.wait(self.stager.to_host(packed, self.prefill_buf))

    def prefill_end(self):
        pass

    def decode_begin(self, minibatches, layers=0, mixed=None):
        self.n = {mb: len(ids) for mb, (ids, _) in enumerate(minibatches)}
        for mb, n in self.n.items():
            if mb not in self.slots:
                self.slots[mb] = {"send": HostBuffer(self.dtype, self.pinned),
                                  "out": [HostBuffer(self.dtype, self.pinned), HostBuffer(self.dtype, self.pinned)],
                                  "ready": None, "out_free": [None, None]}
            for buf in self.slots[mb]["out"]:      # [n, Hq, D] replies, filled once with finite values
                if buf.tensor.numel() < n * self.hq * self.d:
                    buf.ensure(n * self.hq * self.d)
                    buf.tensor.normal_()

    def decode_buffer(self, layer, mb, numel, device, dtype):
        return self.stager.buffer(numel, self.dtype, self.slots[mb]["send"] if self.transfers else None)

    def decode_submit(self, layer, mb, packed):
        slot = self.slots[mb]
        slot["ready"] = self.stager.to_host(packed, slot["send"]) if self.transfers else None

    def decode_wait(self, layer, mb):
        slot = self.slots[mb]
        if not self.transfers:                    # the same finite rows, already on the device
            n = self.n[mb]
            if slot.get("device_out") is None or slot["device_out"].shape[0] != n:
                host = slot["out"][0].tensor[: n * self.hq * self.d].view(n, self.hq, self.d)
                slot["device_out"] = host.to(self.device)
            return slot["device_out"]
        self.stager.wait(slot["ready"])           # a reply cannot come before the rows left
        n = self.n[mb]
        host = slot["out"][layer % 2].tensor[: n * self.hq * self.d].view(n, self.hq, self.d)
        o, slot["out_free"][layer % 2] = self.stager.to_device(host)
        return o

    def decode_end(self):
        return StepStats()

    def free(self, seq_ids_by_worker):
        pass
