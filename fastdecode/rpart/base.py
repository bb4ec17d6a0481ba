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
    kv_layout: str = ""       # hex of its store's layout_signature() (KV blobs move between equal ones);
                              # "": it cannot export or import a sequence's KV
    link: str = ""            # how decode rows reach it when it shares the S-worker's node: "shared
                              # memory", or "MPI (why not)"; "": another node (MPI)


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


class KVImportError(ValueError):
    """A worker refused a sequence's KV blob (malformed, another geometry, or an id it holds).
    Raised after every blob of the call was tried: `stored` says which the worker took."""

    def __init__(self, text: str, rank: int, seq_id: int, stored: list[bool]):
        super().__init__(text)
        self.rank, self.seq_id, self.stored = rank, seq_id, stored

    @classmethod
    def of(cls, rank: int, who: str, refused: list, stored: list[bool]) -> KVImportError:
        """[[seq id, why], ...] refused by `who` -> the error naming it and the first sequence."""
        sid, why = refused[0]
        more = f" (and {len(refused) - 1} more sequences' blobs)" if len(refused) > 1 else ""
        return cls(f"{who} refused the KV blob of sequence {sid}: {why}{more}", rank, int(sid), stored)


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

    # KV hand-over (a stopped job saves its in-flight sequences' KV, its rerun reloads it). Between
    # steps only: after prefill_end / decode_end, before the next prefill_begin / decode_begin; frees
    # passed before go first. kv_layouts: per worker its store's layout signature (two workers with
    # equal signatures take each other's blobs), None where it cannot export or import (the
    # S-worker's device tier, a tensor-parallel shard). export_kv: per worker, each listed sequence's
    # blob (the worker keeps it); ValueError: a list for a worker whose layout is None; KeyError: a
    # sequence the worker does not hold. import_kv: `worker` creates each sequence from its blob,
    # exactly as if prefilled there (later decode rows append and attend, free frees it); per
    # sequence True, or False where its pages would pass the worker's capacity (nothing stored for
    # it). A blob the worker refuses raises KVImportError (naming its rank and the sequence) once
    # every blob was tried. These defaults are a backend's whose workers hold no exportable KV.
    def kv_layouts(self) -> list[bytes | None]:
        return [bytes.fromhex(w.kv_layout) if w.kv_layout else None for w in self.workers]

    def export_kv(self, seq_ids_by_worker: list[list[int]]) -> list[dict[int, bytes]]:
        check_kv_lists(self, seq_ids_by_worker)
        return [{} for _ in self.workers]

    def import_kv(self, worker: int, seq_ids: list[int], blobs: list[bytes]) -> list[bool]:
        check_kv_import(self, worker, seq_ids, blobs)
        return []

    # profiling (`fastdecode profile`): each worker's kernel cost, and one-way link times to each
    # worker alone and to all at once
    def profile_workers(self, seqs: int, target_bytes: int) -> list[dict]: ...
    def ping(self, sizes: list[int], repeats: int) -> list[list[float]]: ...        # [workers, sizes]
    def ping_all(self, sizes: list[int], repeats: int) -> list[float]: ...         # [sizes], all workers at once
    def close(self) -> None: ...

    @property
    def num_workers(self) -> int:
        return len(self.workers)


def check_kv_lists(backend: RBackend, seq_ids_by_worker: list[list[int]]) -> None:
    """An export_kv's lists: one per worker, empty for every worker whose layout is None."""
    layouts = backend.kv_layouts()
    if len(seq_ids_by_worker) != len(layouts):
        raise ValueError(f"export_kv: {len(seq_ids_by_worker)} lists of sequences for {len(layouts)} workers")
    for w, (ids, layout) in enumerate(zip(seq_ids_by_worker, layouts)):
        if len(ids) and layout is None:
            raise ValueError(f"export_kv: worker {w} ({_where(backend.workers[w])}) cannot export KV")


def check_kv_import(backend: RBackend, worker: int, seq_ids: list[int], blobs: list[bytes]) -> None:
    """An import_kv's arguments: a worker that can import, one blob per sequence, no id twice."""
    layouts = backend.kv_layouts()
    if not 0 <= worker < len(layouts):
        raise ValueError(f"import_kv: worker {worker} of {len(layouts)}")
    if len(blobs) != len(seq_ids) or len(set(int(s) for s in seq_ids)) != len(seq_ids):
        raise ValueError(f"import_kv: {len(blobs)} blobs for {len(seq_ids)} sequences (distinct ids, one blob each)")
    if len(seq_ids) and layouts[worker] is None:
        raise ValueError(f"import_kv: worker {worker} ({_where(backend.workers[worker])}) cannot import KV")


def _where(w: WorkerInfo) -> str:
    from fastdecode.launch.ranks import world_rank
    return w.tier or f"rank {world_rank(w.rank)} on {w.host}"


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
