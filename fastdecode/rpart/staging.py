"""Host buffers for activations crossing MPI, and the device <-> host copies that fill them.

On a CUDA S-worker the buffers are pinned, and the copies run on two side streams, one per
direction (PCIe is full duplex: 54 GB/s each way on the H100 box, 47-50 GB/s with both busy), so
that a mini-batch's Q/K/V leave and its attention output arrives while the GPU computes the
other mini-batch. The compute stream never waits on the host: it waits on the copy's event.
Each buffer is a torch tensor and a numpy view of the same memory (bf16 as uint16 bits) that
MPI reads or writes.
"""
from __future__ import annotations

import numpy as np
import torch


def numpy_view(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class HostBuffer:
    """A growable 1-D host buffer of `dtype` (pinned when the S-worker is on CUDA)."""

    def __init__(self, dtype: torch.dtype, pinned: bool):
        self.dtype, self.pinned = dtype, pinned
        self.tensor = torch.empty(0, dtype=dtype)
        self.array = numpy_view(self.tensor)

    def ensure(self, numel: int) -> None:
        if numel > self.tensor.numel():
            size = max(numel, int(self.tensor.numel() * 1.25))
            self.tensor = torch.empty(size, dtype=self.dtype, pin_memory=self.pinned)
            self.array = numpy_view(self.tensor)


class Stager:
    """Device <-> host copies for one S-worker device.

    to_host(src, dst) copies a device tensor into a host buffer once the compute stream's work
    so far is done and returns an event to wait on before MPI reads it (None on a CPU S-worker,
    where it is a plain copy, or nothing when src already is dst).
    to_device(host) returns the host rows as a device tensor that the compute stream may use at
    once (the copy runs on the other side stream), and an event that says when `host` is free.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None

    def buffer(self, numel: int, dtype: torch.dtype, host: HostBuffer | None = None) -> torch.Tensor:
        """Where the S-part writes rows bound for the host: the host buffer itself on a CPU
        S-worker (no copy later), else fresh device memory."""
        if not self.cuda and host is not None:
            host.ensure(numel)
            return host.tensor[:numel]
        return torch.empty(numel, dtype=dtype, device=self.device)

    def to_host(self, src: torch.Tensor, dst: HostBuffer):
        dst.ensure(src.numel())
        out = dst.tensor[: src.numel()]
        if not self.cuda:
            if src.data_ptr() != out.data_ptr():
                out.copy_(src.reshape(-1))
            return None
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ready)
            out.copy_(src.reshape(-1), non_blocking=True)
            src.record_stream(self.d2h)          # src's memory is not reused before the copy ran
            done = torch.cuda.Event()
            done.record(self.d2h)
        return done

    def to_device(self, host: torch.Tensor):
        if not self.cuda:
            return host, None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.h2d):
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        compute.wait_event(done)
        dev.record_stream(compute)
        return dev, done

    @staticmethod
    def wait(event) -> None:
        if event is not None:
            event.synchronize()
