"""The device tier's page bookkeeping: which pages each sequence holds, in order, and its length.

Every layer of a sequence uses the same page ids (the cache is [L, pages, page_tokens, Hkv, D]),
so one table serves all layers and a page holds page_tokens tokens of every layer. Pages are
refcounted: a fork (a shared prompt prefix) starts a sequence on another's first whole pages,
which stay until their last reader frees them. Host-side only (numpy); the tier uploads what a
step needs (slots, block tables, lengths) once per step.
"""
from __future__ import annotations

import numpy as np


class PoolFull(RuntimeError):
    """No free page: placement admitted more than the tier holds (a bug, never a user error)."""


class PagePool:
    def __init__(self, num_pages: int, page_tokens: int):
        if num_pages < 0 or page_tokens < 1:
            raise ValueError(f"a page pool needs num_pages >= 0 and page_tokens >= 1, got {num_pages}, {page_tokens}")
        self.num_pages, self.page_tokens = int(num_pages), int(page_tokens)
        self._free = list(range(self.num_pages - 1, -1, -1))      # a stack: the lowest ids go first
        self._refs = np.zeros(self.num_pages, dtype=np.int32)     # [pages] readers of each page
        self.pages: dict[int, list[int]] = {}                     # seq id -> its page ids, in order
        self.length: dict[int, int] = {}                          # seq id -> tokens it holds

    # ------------------------------------------------------------------ sequences

    def _take(self, seq: int) -> int:
        if not self._free:
            raise PoolFull(f"device KV tier: no free page for sequence {seq} ({self.num_pages} pages of "
                           f"{self.page_tokens} tokens, all held)")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def extend(self, seq: int, tokens: int) -> np.ndarray:
        """Append `tokens` positions to seq (a new sequence starts empty) -> their flat slots
        [tokens] int64 (page * page_tokens + offset), taking pages as they are needed."""
        pages = self.pages.setdefault(seq, [])
        start = self.length.get(seq, 0)
        end = start + int(tokens)
        while len(pages) * self.page_tokens < end:
            pages.append(self._take(seq))
        self.length[seq] = end
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(pages, dtype=np.int64)
        return table[pos // self.page_tokens] * self.page_tokens + pos % self.page_tokens

    def fork(self, src: int, dst: int, tokens: int) -> None:
        """dst starts as the first `tokens` (whole pages) of src, sharing those pages."""
        if tokens % self.page_tokens or tokens > self.length.get(src, 0):
            raise ValueError(f"fork of {tokens} tokens from sequence {src} (holding {self.length.get(src, 0)}): "
                             f"a fork shares whole pages the source holds ({self.page_tokens} tokens each)")
        if dst in self.pages:
            raise ValueError(f"fork into sequence {dst}, which the tier already holds")
        shared = self.pages[src][: tokens // self.page_tokens]
        self._refs[shared] += 1
        self.pages[dst] = list(shared)
        self.length[dst] = int(tokens)

    def free(self, seq: int) -> None:
        for page in reversed(self.pages.pop(seq, [])):      # its first page on top: taken first again
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        self.length.pop(seq, None)

    # ------------------------------------------------------------------ what a step uploads

    def block_table(self, seqs: np.ndarray) -> np.ndarray:
        """[n, max pages] int32 page ids of each sequence, padded with 0 (never read past its length)."""
        rows = [self.pages[int(s)] for s in seqs]
        table = np.zeros((len(rows), max((len(r) for r in rows), default=0) or 1), dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        return table

    def lengths(self, seqs: np.ndarray) -> np.ndarray:
        """[n] int32 tokens each sequence holds."""
        return np.fromiter((self.length[int(s)] for s in seqs), dtype=np.int32, count=len(seqs))

    # ------------------------------------------------------------------ accounting

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def page_reads(self) -> int:
        """Pages summed over their readers (a shared page counts once per sequence reading it)."""
        return int(self._refs.sum())
