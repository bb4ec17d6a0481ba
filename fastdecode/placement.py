"""Which R-worker holds a new sequence's KV-cache.

A sequence goes to the worker with the lowest projected KV load relative to its bandwidth,
never past that worker's capacity. Capacity is reserved for the sequence's worst case
(prompt + max_tokens, rounded up to whole pages), so an admitted sequence can never run a
worker out of memory; when nothing fits the sequence waits.
"""
from __future__ import annotations

import math

from .rpart.base import WorkerInfo
from .sequence import Sequence


class Placement:
    def __init__(self, workers: list[WorkerInfo], kv_bytes_per_token: int,
                 bandwidth: list[float] | None = None):
        self.page = [max(w.page_tokens, 1) for w in workers]
        self.capacity_tokens = [w.capacity_bytes // kv_bytes_per_token for w in workers]
        # relative speed of each worker; measured bytes/s when known, else equal
        self.bandwidth = bandwidth or [1.0] * len(workers)
        self.reserved = [0] * len(workers)        # worst-case tokens of resident sequences
        self.load = [0.0] * len(workers)          # projected tokens: prompt + half the generation

    def _bound(self, w: int, seq: Sequence) -> int:
        return math.ceil(seq.total_len_bound / self.page[w]) * self.page[w]

    @staticmethod
    def _projected(seq: Sequence) -> float:
        return seq.prompt_len + seq.max_tokens / 2

    def fits_anywhere_alone(self, seq: Sequence) -> bool:
        """False if no worker could hold this sequence even when empty (a request error)."""
        return any(self._bound(w, seq) <= cap for w, cap in enumerate(self.capacity_tokens))

    def place(self, seq: Sequence) -> int | None:
        best, best_cost = None, math.inf
        for w, cap in enumerate(self.capacity_tokens):
            need = self._bound(w, seq)
            if self.reserved[w] + need > cap:
                continue
            cost = (self.load[w] + self._projected(seq)) / self.bandwidth[w]
            if cost < best_cost:
                best, best_cost = w, cost
        if best is not None:
            self.reserved[best] += self._bound(best, seq)
            self.load[best] += self._projected(seq)
            seq.worker = best
        return best

    def release(self, seq: Sequence) -> None:
        w = seq.worker
        self.reserved[w] -= self._bound(w, seq)
        self.load[w] -= self._projected(seq)

    def total_capacity_tokens(self) -> int:
        return sum(self.capacity_tokens)

    def free_tokens(self) -> int:
        return sum(c - r for c, r in zip(self.capacity_tokens, self.reserved))
