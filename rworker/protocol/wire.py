"""The data messages' layout: where each row's q, k and v lie in a buffer (numpy only).

Decode, one mini-batch: rows are grouped by R-worker (counts[w] consecutive rows belong to
worker w). Worker w's block is [q: n_w*Hq*D | k: n_w*Hkv*D | v: n_w*Hkv*D] and the blocks follow
in worker order, so each R-worker gets one contiguous message and the S-part fills the whole
buffer in one pass. Prefill, one layer: each worker's block is [k: n_w*Hkv*D | v: n_w*Hkv*D].
`views` and `split_*` slice and reshape only, so they serve numpy arrays and torch tensors alike.
"""
from __future__ import annotations

import numpy as np


def split_qkv(block, n: int, hq: int, hkv: int, d: int):
    """One worker's decode block -> (q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]) views."""
    nq, nk = n * hq * d, n * hkv * d
    return (block[:nq].reshape(n, hq, d), block[nq:nq + nk].reshape(n, hkv, d),
            block[nq + nk:nq + 2 * nk].reshape(n, hkv, d))


def split_kv(block, n: int, hkv: int, d: int):
    """One worker's prefill block -> (k [n, Hkv, D], v [n, Hkv, D]) views."""
    nk = n * hkv * d
    return block[:nk].reshape(n, hkv, d), block[nk:2 * nk].reshape(n, hkv, d)


class WireLayout:
    """The decode layout of one mini-batch over the R-workers."""

    def __init__(self, counts: list[int], hq: int, hkv: int, d: int):
        self.counts = [int(c) for c in counts]
        self.hq, self.hkv, self.d = hq, hkv, d
        self.row_elems = (hq + 2 * hkv) * d
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)   # [W + 1] rows
        self.rows = int(self.starts[-1])

    def numel(self) -> int:
        return self.rows * self.row_elems

    def bounds(self) -> list[tuple[int, int]]:
        """(first row, end row) of each worker."""
        return [(int(s), int(e)) for s, e in zip(self.starts[:-1], self.starts[1:])]

    def block(self, w: int) -> tuple[int, int]:
        """(first element, end element) of worker w's block in the buffer."""
        return int(self.starts[w]) * self.row_elems, int(self.starts[w + 1]) * self.row_elems

    def views(self, buf) -> list[tuple]:
        """Per worker the (q [n_w, Hq, D], k [n_w, Hkv, D], v [n_w, Hkv, D]) views into buf."""
        return [split_qkv(buf[slice(*self.block(w))], n, self.hq, self.hkv, self.d)
                for w, n in enumerate(self.counts)]

    def offsets(self) -> np.ndarray:
        """[rows, 3] int64: element offset of each row's q, k and v in the buffer (fused packing)."""
        off = np.empty((self.rows, 3), dtype=np.int64)
        for s, e in self.bounds():
            n = e - s
            local = np.arange(n, dtype=np.int64)
            b = s * self.row_elems
            off[s:e, 0] = b + local * self.hq * self.d
            off[s:e, 1] = b + n * self.hq * self.d + local * self.hkv * self.d
            off[s:e, 2] = b + n * (self.hq + self.hkv) * self.d + local * self.hkv * self.d
        return off
