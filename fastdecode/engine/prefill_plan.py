"""One step's prompt rows (whole prompts or chunks of them) and the K/V that chunked prefill keeps
on the S-worker between a prompt's chunks (and that a shared prefix's members start from)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fastdecode.engine.sequence import Sequence
from fastdecode.rpart.base import RBackend


class PrefillPlan:
    """One step's prompt rows: sequence i's chunk covers KV positions starts[i] .. ends[i]-1."""

    def __init__(self, seqs: list[Sequence], starts: list[int], ends: list[int]):
        self.seqs, self.starts, self.ends = seqs, starts, ends
        self.lengths = [e - b for b, e in zip(starts, ends)]
        self.rows = sum(self.lengths)
        self.done = [e == s.kv_len for s, e in zip(seqs, ends)]     # this chunk ends the prompt
        self.seq_ids = np.array([s.seq_id for s in seqs], dtype=np.int64)
        self.row_ids = np.repeat(self.seq_ids, self.lengths)         # [T]
        self.tokens = self.positions = None                          # [T] on the S-worker's device
        self.worker_rows: list[int] = []
        self.reserve = None
        self.continued = np.zeros(0, np.int64)
        self.forks = None           # (dst ids, src ids, tokens, counts per worker): members of shared prefixes
        self.context_fn = None      # chunk_context(...) where a chunk attends to earlier ones, else None

    def begin(self, be: RBackend, layers: int) -> None:
        be.prefill_begin(self.row_ids, self.worker_rows, layers, reserve=self.reserve, continued=self.continued,
                         forks=self.forks)

    def context(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list | None:
        """What each chunk attends to at `layer` (prompt_attention's context); None: its own rows."""
        return None if self.context_fn is None else self.context_fn(layer, k, v)


def chunk_context(kept: dict[int, list], num_layers: int, seqs: list[Sequence], starts: list[int],
                  lengths: list[int], done: list[bool], capture: dict[int, int] | None = None,
                  keep: Callable | None = None):
    """For a step with prompt chunks: layer -> per sequence the K/V its chunk attends to (the
    earlier chunks' from `kept`, then its own; None: its own rows alone). `kept` (seq id -> per
    layer (K, V) [p, Hkv, D]) holds the K/V of a sequence whose prompt goes on next step, until
    its last chunk (and, seeded by the caller, a shared prefix's K/V for a member starting after it).
    capture {i: t}: sequence i donates a shared prefix: keep(seq, layer, K, V) gets copies of its
    positions 0..t-1 [t, Hkv, D] once its chunk reaches them."""
    capture = capture or {}
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    for s, d in zip(seqs, done):
        if not d and s.seq_id not in kept:
            kept[s.seq_id] = [None] * num_layers

    def context(layer: int, k: torch.Tensor, v: torch.Tensor) -> list:
        out = []
        for i, s in enumerate(seqs):
            rows = slice(int(bounds[i]), int(bounds[i + 1]))
            earlier = kept[s.seq_id][layer] if starts[i] else None          # ([p, Hkv, D], [p, Hkv, D])
            kv = (k[rows], v[rows]) if earlier is None else \
                (torch.cat([earlier[0], k[rows]]), torch.cat([earlier[1], v[rows]]))
            t = capture.get(i, 0)
            if starts[i] < t <= starts[i] + lengths[i]:
                keep(s, layer, kv[0][:t].clone(), kv[1][:t].clone())
            if not done[i]:
                kept[s.seq_id][layer] = (kv[0].clone(), kv[1].clone()) if earlier is None else kv
            elif s.seq_id in kept and layer == num_layers - 1:
                del kept[s.seq_id]
            out.append(None if earlier is None else kv)
        return out
    return context
