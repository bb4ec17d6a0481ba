"""Runs the model over a batch: prefill on the S-worker, decode with the R-part per layer.

Rows are ordered by R-worker so each worker's rows are one contiguous slice.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .model.llama import LlamaSPart
from .rpart.base import RBackend, StepStats
from .sampler import SamplingBatch, sample
from .sequence import Sequence


def group_by_worker(seqs: list[Sequence], num_workers: int) -> tuple[list[Sequence], list[int]]:
    """Stable sort by worker -> (ordered sequences, rows per worker)."""
    ordered = sorted(seqs, key=lambda s: s.worker)
    counts = [0] * num_workers
    for s in ordered:
        counts[s.worker] += 1
    return ordered, counts


class ModelRunner:
    def __init__(self, model: LlamaSPart, backend: RBackend, eos_ids: frozenset[int]):
        self.model, self.backend = model, backend
        self.device = model.device
        self.eos_ids = eos_ids
        self.last_s_time = 0.0          # S-worker compute (incl. waiting it could not hide), seconds
        self.last_r_wait = 0.0          # S-worker time blocked on R-worker replies

    def _sampling_rows(self, seqs: list[Sequence]) -> SamplingBatch:
        rows = []
        for s in seqs:
            p = s.request.params
            suppress = None
            if len(s.output_ids) < p.min_tokens:
                suppress = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids))
            rows.append((p, s.request.seed, s.sample_index, len(s.output_ids), suppress))
        return SamplingBatch(rows, self.device)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> tuple[list[Sequence], np.ndarray]:
        """Prompt forward for `seqs`; their K/V go to their workers. -> (seqs in row order, first tokens)."""
        m, be = self.model, self.backend
        seqs, counts = group_by_worker(seqs, be.num_workers)
        lengths = [s.prompt_len for s in seqs]
        tokens = torch.tensor([t for s in seqs for t in s.request.prompt_ids], device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        row_ids = np.repeat(np.array([s.seq_id for s in seqs], dtype=np.int64), lengths)
        worker_rows = [sum(n for s, n in zip(seqs, lengths) if s.worker == w) for w in range(be.num_workers)]
        be.prefill_begin(row_ids, worker_rows)
        x = m.embed_tokens(tokens)                                   # [T, h]
        cos, sin = m.rope.cos_sin(positions)
        for layer in range(m.config.num_layers):
            q, k, v = m.qkv(layer, x, cos, sin)
            be.prefill_layer(layer, k, v)
            o = m.prompt_attention(q, k, v, lengths)
            x = m.post_attn(layer, x, o)
        be.prefill_end()
        last = torch.tensor(np.cumsum(lengths) - 1, device=self.device)
        logits = m.logits(x[last])                                   # [n, V]
        return seqs, sample(logits, self._sampling_rows(seqs))

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[list[Sequence], np.ndarray, StepStats | None]:
        """One token for every sequence. -> (seqs in row order, next tokens, R-side stats)."""
        m, be = self.model, self.backend
        seqs, counts = group_by_worker(seqs, be.num_workers)
        ids = np.array([s.seq_id for s in seqs], dtype=np.int64)
        tokens = torch.tensor([s.last_token for s in seqs], device=self.device)
        positions = torch.tensor([s.kv_len for s in seqs], device=self.device)
        t0 = time.perf_counter()
        r_wait = 0.0
        be.decode_begin([(ids, counts)])
        x = m.embed_tokens(tokens)                                   # [n, h]
        cos, sin = m.rope.cos_sin(positions)
        for layer in range(m.config.num_layers):
            q, k, v = m.qkv(layer, x, cos, sin)
            be.decode_submit(layer, 0, q, k, v)
            tw = time.perf_counter()
            o = be.decode_wait(layer, 0).to(self.device)            # [n, Hq, D]
            r_wait += time.perf_counter() - tw
            x = m.post_attn(layer, x, o)
        logits = m.logits(x)
        next_tokens = sample(logits, self._sampling_rows(seqs))
        stats = be.decode_end()
        self.last_r_wait = r_wait
        self.last_s_time = time.perf_counter() - t0 - r_wait
        return seqs, next_tokens, stats
