"""Runs the model over a batch: prefill on the S-worker, decode with the R-part per layer.

Rows of a batch are ordered by R-worker so each worker's rows are one contiguous slice.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .model.llama import LlamaSPart
from .rpart.base import RBackend, StepStats
from .rpart.staging import host_to_device
from .rpart.wire import WireLayout
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
        # one pass over the sequences; the rest of the bookkeeping is numpy (B can be 16k rows)
        meta = np.array([(s.seq_id, s.worker, s.prompt_len + len(s.output_ids) - 1, s.output_ids[-1])
                         for s in seqs], dtype=np.int64).reshape(-1, 4)        # [B, (id, worker, kv_len, token)]
        plans = []
        for rows in split_by_r_load(meta[:, 2], meta[:, 0], self.depth):
            rows = rows[np.lexsort((meta[rows, 0], meta[rows, 1]))]          # by worker, then seq id
            counts = np.bincount(meta[rows, 1], minlength=be.num_workers).tolist()
            plans.append(([seqs[i] for i in rows], counts, meta[rows, 0].copy(), rows))
        t0 = time.perf_counter()
        r_wait = 0.0
        be.decode_begin([(ids, counts) for _, counts, ids, _ in plans])
        c = m.config
        layouts = [WireLayout(counts, c.num_heads, c.num_kv_heads, c.head_dim) for _, counts, _, _ in plans]

        def submit(layer: int, mb: int) -> None:     # q|k|v of one mini-batch, straight into the wire layout
            out = be.decode_buffer(layer, mb, layouts[mb].numel(), self.device, m.dtype)
            m.qkv_packed(layer, xs[mb], *rope[mb], layouts[mb], out)
            be.decode_submit(layer, mb, out)

        xs, rope = [], []
        for mb, (_, _, _, rows) in enumerate(plans):
            tokens = host_to_device(meta[rows, 3], self.device)
            positions = host_to_device(meta[rows, 2], self.device)
            xs.append(m.embed_tokens(tokens))                              # [n_mb, h]
            rope.append(m.rope.cos_sin(positions, int(meta[rows, 2].max())))
            submit(0, mb)
        last = m.config.num_layers - 1
        sampled, sampling = [], None
        for layer in range(m.config.num_layers):
            for mb in range(len(plans)):
                tw = time.perf_counter()
                o = be.decode_wait(layer, mb)                              # [n_mb, Hq, D]
                r_wait += time.perf_counter() - tw
                xs[mb] = m.post_attn(layer, xs[mb], o)
                if layer < last:
                    submit(layer + 1, mb)
                if sampling is None:    # built while the device has a layer queued, not after the last
                    sampling = [self._sampling_rows(part) for part, _, _, _ in plans]
                if layer == last:       # this mini-batch's LM head and sampling run while the R-workers attend the next
                    sampled.append(sample(m.logits(xs[mb]), sampling[mb]))    # [n_mb]
        ordered = [s for part, _, _, _ in plans for s in part]
        next_tokens = np.concatenate(sampled) if len(sampled) > 1 else sampled[0]
        stats = be.decode_end()
        self.decode_rows += len(ordered)
        self.last_r_wait = r_wait
        self.last_s_time = time.perf_counter() - t0 - r_wait
        return ordered, next_tokens, stats


def split_by_r_load(kv_len: np.ndarray, seq_id: np.ndarray, depth: int) -> list[np.ndarray]:
    """Up to `depth` non-empty mini-batches (row indices) of about equal total KV length (the
    R-part's cost): rows sorted longest first (ties by sequence id) are dealt out in snake order
    0, 1, .., d-1, d-1, .., 0, 0, 1, .. so every mini-batch gets one of each d consecutive lengths;
    the loads differ by at most the longest sequence. Depends only on the lengths and ids."""
    n = len(kv_len)
    depth = max(1, min(depth, n))
    if depth == 1:
        return [np.arange(n)]
    order = np.lexsort((seq_id, -kv_len))
    pos = np.arange(n) % (2 * depth)
    mb = np.where(pos < depth, pos, 2 * depth - 1 - pos)
    return [np.sort(order[mb == i]) for i in range(depth)]
