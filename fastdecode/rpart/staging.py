"""Host buffers for activations crossing MPI, reused across layers and steps.

On a CUDA S-worker they are pinned and filled/drained by non-blocking copies on a side stream,
so the copies overlap the other mini-batch's compute. Each buffer is a torch tensor and a numpy
view of the same memory (bf16 as uint16 bits) that MPI reads or writes.
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

    to_host(parts) packs the given device tensors back to back into a host buffer (one gather
    kernel and one copy on CUDA) and returns an event to wait on before MPI reads the buffer.
    to_device(buf, shape) returns the host rows as a device tensor (async on CUDA).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, parts: list[torch.Tensor], buf: HostBuffer):
        numel = sum(p.numel() for p in parts)
        buf.ensure(numel)
        dst = buf.tensor[:numel]
        if not self.cuda:
            torch.cat([p.reshape(-1) for p in parts], out=dst)
            return None
        packed = torch.cat([p.reshape(-1) for p in parts])              # on the compute stream
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            dst.copy_(packed, non_blocking=True)
            packed.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return host
        out = host.to(self.device, non_blocking=True)
        return out

    @staticmethod
    def wait(event) -> None:
        if event is not None:
            event.synchronize()
