"""What the engine needs from the R-part, wherever it runs (in-process or on MPI ranks).

Rows of every batch handed to a backend are grouped by R-worker: `counts[w]` consecutive rows
belong to worker w, in worker order. The backend slices, never gathers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rworker.protocol.wire import WireLayout


@dataclass(slots=True)
class WorkerInfo:
    rank: int                 # MPI rank (0 in local mode)
    host: str
    threads: int
    isa: str
    capacity_bytes: int
    page_tokens: int = 1      # KV is allocated in pages of this many tokens per (seq, layer)
    pid: int = 0
    kernel: str = ""          # the attention kernel's V layout and prefetch, and how they were chosen
    forks: bool = False       # its store can start a sequence sharing another's prefix pages (prefix sharing)
    tier: str = ""            # "": an R-worker (or local mode's store); else the S-worker's own KV tier
                              # ("device (cuda:0)", "local"), which runs its attention in-process
    frees_windows: bool = True    # a sliding-window layer's pages leave once outside the window
    attend_gbps: float = 0.0  # its attention kernel's KV read rate, GB/s (0: not measured)
    attend_call_s: float = 0.0    # its kernel's fixed seconds per call (one layer of one mini-batch), when measured


@dataclass(slots=True)
class StepStats:
    """One decode step as the R-workers saw it (per worker, seconds and bytes)."""
    attend_s: list[float] = field(default_factory=list)   # time inside the kernel
    busy_s: list[float] = field(default_factory=list)     # step time not spent waiting for the S-worker
    kv_bytes: list[int] = field(default_factory=list)     # KV bytes held after the step (pages with
                                                          # tokens or reserved; extent slack not counted)
    append_s: list[float] = field(default_factory=list)   # prefill K/V appends since the last step
    kv_saved_bytes: list[int] = field(default_factory=list)   # KV bytes shared prefix pages save (held once,
                                                              # read by several sequences)


@dataclass(slots=True)
class PrefillTimes:
    """One prefill as the S-worker's side of the R-part saw it (seconds, host clock)."""
    pack_s: float = 0.0       # K/V into the wire buffer (MPI) or into the store's input arrays (local)
    wait_s: float = 0.0       # blocked: a wire buffer still in flight, the last layers' sends or appends
    append_s: float = 0.0     # local mode: the store's appends on this process's R-part


class RBackend:
    workers: list[WorkerInfo]
    prefill_times: PrefillTimes      # the last prefill's hand-off, reset by prefill_begin

    # prefill: rows are prompt tokens; row_ids[r] = seq id of row r (a prompt's rows consecutive).
    # `layers`: the step covers the model's first `layers` layers (0: all; profiling uses fewer).
    # `reserve`: (seq_ids [n], tokens [n], counts per worker), grouped like the rows: the KV tokens
    # each new sequence reserves (placement's count), which its worker takes as pages now so that
    # the sequence's KV stays one run of pages per (layer, head) as it grows (a layout hint only).
    # `continued`: seq ids whose earlier prompt chunks the worker holds; their rows append to them.
    # `forks`: (dst ids [f], src ids [f], tokens [f], counts per worker), grouped like the rows: each
    # dst starts on its worker sharing the first tokens (whole pages) of src, which the worker
    # holds; done before the reservations (a forked dst reserves too, its shared pages counting)
    # and the appends (dst's rows append after the shared tokens).
    def prefill_begin(self, row_ids: np.ndarray, counts: list[int], layers: int = 0,
                      reserve: tuple[np.ndarray, np.ndarray, list[int]] | None = None,
                      continued: np.ndarray | None = None,
                      forks: tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None = None) -> None: ...
    def prefill_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def prefill_end(self) -> None: ...

    # decode: one row per sequence; per mini-batch its seq ids and per-worker counts. Per layer the
    # S-part writes a mini-batch's q|k|v rows in the wire layout (TorchWireLayout of the
    # counts) into decode_buffer(...), hands it over with decode_submit and gets O [n, Hq, D]
    # back from decode_wait.
    # `mixed[w]`: worker w also gets this step's prompt chunks, prefill_begin right after decode_begin and
    # per layer prefill_layer after decode_submit (a chunked-prefill step; runner.mixed).
    def decode_begin(self, minibatches: list[tuple[np.ndarray, list[int]]], layers: int = 0,
                     mixed: list[bool] | None = None) -> None: ...
    def decode_buffer(self, layer: int, mb: int, numel: int, device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor: ...
    def decode_submit(self, layer: int, mb: int, packed: torch.Tensor) -> None: ...
    def decode_wait(self, layer: int, mb: int) -> torch.Tensor: ...
    def decode_end(self) -> StepStats | None: ...

    def free(self, seq_ids_by_worker: list[list[int]]) -> None: ...

    # profiling (`fastdecode profile`): each worker's kernel cost, and one-way link times to each
    # worker alone and to all at once
    def profile_workers(self, seqs: int, target_bytes: int) -> list[dict]: ...
    def ping(self, sizes: list[int], repeats: int) -> list[list[float]]: ...        # [workers, sizes]
    def ping_all(self, sizes: list[int], repeats: int) -> list[float]: ...         # [sizes], all workers at once
    def close(self) -> None: ...

    @property
    def num_workers(self) -> int:
        return len(self.workers)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A host numpy view of an activation; bf16 is reinterpreted as uint16 bits (no conversion)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy() if hasattr(torch, "uint16") else t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype != torch.float32:
        t = t.float()
    return t.numpy()


class TorchWireLayout(WireLayout):
    """The wire layout with its row offsets uploaded once per device, for the fused packing kernel."""

    def __init__(self, counts: list[int], hq: int, hkv: int, d: int):
        super().__init__(counts, hq, hkv, d)
        self._device_offsets: dict[torch.device, torch.Tensor] = {}

    def row_offsets(self, device: torch.device) -> torch.Tensor:
        """[rows, 3] int64 on `device` (a synchronous copy: the runner asks before queueing kernels)."""
        if device not in self._device_offsets:
            self._device_offsets[device] = torch.from_numpy(self.offsets()).to(device)
        return self._device_offsets[device]
