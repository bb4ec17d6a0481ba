"""The wire layout of one mini-batch's Q/K/V rows: what the S-part writes and the R-workers read.

Rows are grouped by R-worker (counts[w] consecutive rows belong to worker w). Worker w's block
is [q: n_w*Hq*D | k: n_w*Hkv*D | v: n_w*Hkv*D] and the blocks follow in worker order, so each
R-worker gets one contiguous message and the S-part fills the whole buffer in one pass.
"""
from __future__ import annotations

import numpy as np
import torch


class WireLayout:
    def __init__(self, counts: list[int], hq: int, hkv: int, d: int):
        self.counts = [int(c) for c in counts]
        self.hq, self.hkv, self.d = hq, hkv, d
        self.row_elems = (hq + 2 * hkv) * d
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)   # [W + 1] rows
        self.rows = int(self.starts[-1])
        self._offsets: dict[torch.device, torch.Tensor] = {}

    def numel(self) -> int:
        return self.rows * self.row_elems

    def bounds(self) -> list[tuple[int, int]]:
        """(first row, end row) of each worker."""
        return [(int(s), int(e)) for s, e in zip(self.starts[:-1], self.starts[1:])]

    def block(self, w: int) -> tuple[int, int]:
        """(first element, end element) of worker w's block in the buffer."""
        return int(self.starts[w]) * self.row_elems, int(self.starts[w + 1]) * self.row_elems

    def views(self, buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per worker the (q [n_w, Hq, D], k [n_w, Hkv, D], v [n_w, Hkv, D]) views into buf."""
        out = []
        for w, n in enumerate(self.counts):
            b, _ = self.block(w)
            nq, nk = n * self.hq * self.d, n * self.hkv * self.d
            out.append((buf[b:b + nq].view(n, self.hq, self.d),
                        buf[b + nq:b + nq + nk].view(n, self.hkv, self.d),
                        buf[b + nq + nk:b + nq + 2 * nk].view(n, self.hkv, self.d)))
        return out

    def row_offsets(self, device: torch.device) -> torch.Tensor:
        """[rows, 3] int64: element offset of each row's q, k and v in the buffer (for fused packing);
        uploaded once per device (a synchronous copy: the runner asks before queueing kernels)."""
        if device not in self._offsets:
            off = np.empty((self.rows, 3), dtype=np.int64)
            for w, (s, e) in enumerate(self.bounds()):
                n = e - s
                local = np.arange(n, dtype=np.int64)
                b = s * self.row_elems
                off[s:e, 0] = b + local * self.hq * self.d
                off[s:e, 1] = b + n * self.hq * self.d + local * self.hkv * self.d
                off[s:e, 2] = b + n * (self.hq + self.hkv) * self.d + local * self.hkv * self.d
            self._offsets[device] = torch.from_numpy(off).to(device)
        return self._offsets[device]
