"""Runs the model over a batch: prefill on the S-worker, decode with the R-part per layer.

Rows of a batch are ordered by R-worker so each worker's rows are one contiguous slice.
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
    def __init__(self, model: LlamaSPart, backend: RBackend, eos_ids: frozenset[int], depth: int = 2):
        self.model, self.backend = model, backend
        self.depth = depth
        self.device = model.device
        self.eos_ids = eos_ids
        self.last_s_time = 0.0          # S-worker compute (incl. waiting it could not hide), seconds
        self.last_r_wait = 0.0          # S-worker time blocked on R-worker replies
        self.decode_rows = 0            # sequence-steps decoded (rows that crossed to the R-part)
        self.prefill_rows = 0           # prompt tokens whose K/V were shipped

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
        self.prefill_rows += len(row_ids)
        last = torch.tensor(np.cumsum(lengths) - 1, device=self.device)
        logits = m.logits(x[last])                                   # [n, V]
        return seqs, sample(logits, self._sampling_rows(seqs))

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[list[Sequence], np.ndarray, StepStats | None]:
        """One token for every sequence. -> (seqs in row order, next tokens, R-side stats).

        With depth k the sequences form k mini-batches of about equal R-load; per layer the
        S-part of one runs while the R-workers attend the others (FastDecode Fig. 4b):
            submit qkv(0, every mb)
            for layer: for mb: o = wait(layer, mb); x = post_attn(layer, x, o); submit qkv(layer + 1, mb)
        and after the last layer each mini-batch samples at once, while the others are still attended.
        """
        m, be = self.model, self.backend
        mbs = split_by_r_load(seqs, self.depth)
        plans = []
        for part in mbs:
            ordered, counts = group_by_worker(part, be.num_workers)
            plans.append((ordered, counts, np.array([s.seq_id for s in ordered], dtype=np.int64)))
        t0 = time.perf_counter()
        r_wait = 0.0
        be.decode_begin([(ids, counts) for _, counts, ids in plans])
        xs, rope = [], []
        for mb, (ordered, _, _) in enumerate(plans):
            tokens = torch.tensor([s.last_token for s in ordered], device=self.device)
            positions = torch.tensor([s.kv_len for s in ordered], device=self.device)
            xs.append(m.embed_tokens(tokens))                              # [n_mb, h]
            rope.append(m.rope.cos_sin(positions))
            be.decode_submit(0, mb, *m.qkv(0, xs[mb], *rope[mb]))
        last = m.config.num_layers - 1
        sampled = []
        for layer in range(m.config.num_layers):
            for mb, (mb_seqs, _, _) in enumerate(plans):
                tw = time.perf_counter()
                o = be.decode_wait(layer, mb)                              # [n_mb, Hq, D]
                r_wait += time.perf_counter() - tw
                xs[mb] = m.post_attn(layer, xs[mb], o)
                if layer < last:
                    be.decode_submit(layer + 1, mb, *m.qkv(layer + 1, xs[mb], *rope[mb]))
                else:   # this mini-batch's LM head and sampling run while the R-workers attend the next
                    sampled.append(sample(m.logits(xs[mb]), self._sampling_rows(mb_seqs)))   # [n_mb]
        ordered = [s for part, _, _ in plans for s in part]
        next_tokens = np.concatenate(sampled) if len(sampled) > 1 else sampled[0]
        stats = be.decode_end()
        self.decode_rows += len(ordered)
        self.last_r_wait = r_wait
        self.last_s_time = time.perf_counter() - t0 - r_wait
        return ordered, next_tokens, stats


def split_by_r_load(seqs: list[Sequence], depth: int) -> list[list[Sequence]]:
    """Up to `depth` non-empty mini-batches with about equal total KV length (the R-part's cost),
    longest first into the lightest (LPT); sequence ids keep each mini-batch's order stable."""
    depth = max(1, min(depth, len(seqs)))
    if depth == 1:
        return [seqs]
    loads = [0] * depth
    parts: list[list[Sequence]] = [[] for _ in range(depth)]
    for s in sorted(seqs, key=lambda s: (-s.kv_len, s.seq_id)):
        i = loads.index(min(loads))
        parts[i].append(s)
        loads[i] += s.kv_len + 1
    return [sorted(p, key=lambda s: s.seq_id) for p in parts]
