"""CUDA graphs of a decode mini-batch's dense work between two attentions.

Between the R-part's reply for layer l and the Q/K/V it needs for layer l + 1, the S-part runs
post_attn(l) (O projection, residual, RMSNorm, gate/up, SiLU*up, down, residual; Gemma: more
norms) and the QKV projection of layer l + 1 (RMSNorm, GEMM): ~8 launches from Python. At B = 1024
on an H100 that is ~0.36 ms of GPU work per mini-batch and layer, so the host's launches bound the step
(bench/gpu/NOTES.md). One graph per (layer, mini-batch slot, row bucket) makes it a replay.

What stays outside the graph: the copies (their streams and events belong to the transport),
RoPE + wire packing (its offsets change with every step's per-worker counts), the first layer's
projection, the LM head and sampling.

Static buffers per (slot, bucket): the residual stream x [nb, h], the attention output o
[nb, Hq, D] and the projections qkv [nb, (Hq + 2 Hkv) D]. A mini-batch of n rows uses the first
n; rows n..nb are stale but finite and every op is row-wise, so they never touch real rows.

On a CPU S-worker (or capture=False) the same padded static-buffer path runs eagerly: that is
what the CPU tests check against the plain path; only the capture itself needs a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_BUCKET = 16


def bucket_rows(n: int) -> int:
    """Rows a graph is captured for: n rounded up to 16, 24, 32, 48, 64, 96, .. (powers of two
    and 1.5x powers of two), so padding wastes at most a third of a bucket."""
    b = MIN_BUCKET
    while b < n:
        if b * 3 // 2 >= n:
            return b * 3 // 2
        b *= 2
    return b


@dataclass
class _Slot:
    x: torch.Tensor       # [nb, h] residual stream
    o: torch.Tensor       # [nb, Hq, D] attention output of the current layer
    qkv: torch.Tensor     # [nb, (Hq + 2 Hkv) D] the next layer's projections (before RoPE)


class LayerGraphs:
    """Runs post_attn(l) + qkv projection(l + 1) of a mini-batch from static buffers, replayed
    from a CUDA graph when `capture` (default: the model is on CUDA)."""

    def __init__(self, model, max_rows: int = 2048, capture: bool | None = None):
        self.model = model
        self.max_rows = max_rows
        self.capture = model.device.type == "cuda" if capture is None else capture
        # routed experts pick their rows at run time: such layers run eagerly from the buffers
        self.capture = self.capture and getattr(model, "graph_safe", True)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.slots: dict[tuple[int, int], _Slot] = {}              # (slot, bucket) -> buffers
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}   # (layer, slot, bucket, has_next)
        self.active: dict[int, tuple[_Slot, int]] = {}             # slot -> (buffers, rows) this step
        self.captures = 0

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def begin(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """x: [n, h] embeddings of a mini-batch -> its residual stream in the static buffer [n, h]."""
        n = x.shape[0]
        nb = bucket_rows(n)
        buf = self.slots.get((slot, nb))
        if buf is None:
            m, c = self.model, self.model.config
            new = lambda *shape, dt=m.dtype: torch.zeros(*shape, dtype=dt, device=m.device)   # noqa: E731
            buf = self.slots[(slot, nb)] = _Slot(new(nb, c.hidden_size, dt=m.residual_dtype),
                                                 new(nb, c.num_heads, c.head_dim), new(nb, c.q_size + 2 * c.kv_size))
        buf.x[:n].copy_(x)
        self.active[slot] = (buf, n)
        return buf.x[:n]

    def layer(self, layer: int, slot: int, o: torch.Tensor) -> torch.Tensor | None:
        """o: [n, Hq, D] this layer's attention output -> the next layer's projections [n, (Hq +
        2 Hkv) D] (None after the last layer); the residual stream advances in place."""
        buf, n = self.active[slot]
        buf.o[:n].copy_(o)
        has_next = layer + 1 < self.model.config.num_layers     # (profiling may run fewer layers)
        if self.capture:
            key = (layer, slot, buf.x.shape[0], has_next)
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(layer, buf, has_next)
            graph.replay()
        else:
            self._body(layer, buf, has_next)
        return buf.qkv[:n] if has_next else None

    def _body(self, layer: int, buf: _Slot, has_next: bool) -> None:
        m = self.model
        buf.x.copy_(m.post_attn(layer, buf.x, buf.o))
        if has_next:
            buf.qkv.copy_(m.qkv_proj(layer + 1, buf.x))

    def _capture(self, layer: int, buf: _Slot, has_next: bool) -> torch.cuda.CUDAGraph:
        # warm-up runs execute (cuBLAS/Triton pick and compile their kernels): keep the live rows
        saved = buf.x.clone()
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                buf.x.copy_(saved)
                self._body(layer, buf, has_next)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the MPI transport's progress thread may call into CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._body(layer, buf, has_next)
        buf.x.copy_(saved)            # capture ran nothing; the warm-ups moved x on
        self.captures += 1
        return graph
