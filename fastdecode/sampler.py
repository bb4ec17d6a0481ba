"""Batched sampling with vLLM's semantics and per-sequence, batch-independent randomness.

Each sampled row draws its uniform from a counter-based hash of (seed, sample index, output
position), so a request's tokens depend only on its logits, parameters and seed: never on what
else is in the batch, on scheduling, or on the number of R-workers.
"""
from __future__ import annotations

import numpy as np
import torch

from .rpart.staging import host_to_device

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer: a bijective 64-bit mix (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def uniforms(seeds: np.ndarray, streams: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 in [0, 1) for each (seed, stream, position) row; all uint64/int64 arrays [n]."""
    key = splitmix64(seeds.astype(np.uint64))
    key = splitmix64(key ^ streams.astype(np.uint64))
    bits = splitmix64(key ^ positions.astype(np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class SamplingBatch:
    """Per-row sampling parameters of one decode batch, as tensors on the logits' device."""

    __slots__ = ("temperature", "top_k", "top_p", "min_p", "greedy", "needs_filter",
                 "seeds", "streams", "positions", "suppress")

    def __init__(self, rows, device):
        # rows: list of (SamplingParams, seed:int, stream:int, position:int, suppress_ids:list[int]|None)
        n = len(rows)
        cols = np.array([(p.temperature, p.top_k, p.top_p, p.min_p) for p, *_ in rows],
                        dtype=np.float64).reshape(n, 4)                 # one pass: B can be 16k rows
        temperature = cols[:, 0]
        device = torch.device(device)
        self.greedy = host_to_device(temperature == 0, device)
        self.temperature = host_to_device(np.where(temperature == 0, 1.0, temperature).astype(np.float32),
                                          device)[:, None]
        self.top_k = cols[:, 1].astype(np.int64).tolist()
        self.top_p = cols[:, 2].tolist()
        self.min_p = cols[:, 3].tolist()
        self.needs_filter = bool((cols[:, 1] > 0).any() or (cols[:, 2] < 1).any() or (cols[:, 3] > 0).any())
        self.seeds = np.fromiter((r[1] for r in rows), np.uint64, n)
        self.streams = np.fromiter((r[2] for r in rows), np.uint64, n)
        self.positions = np.fromiter((r[3] for r in rows), np.uint64, n)
        self.suppress = [r[4] for r in rows]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> np.ndarray:
    """logits: [n, V] float32 -> token ids int64 [n] (numpy)."""
    n, vocab = logits.shape
    if any(s for s in batch.suppress):   # min_tokens: EOS/stop ids may not end the sequence yet
        logits = logits.clone()
        for row, ids in enumerate(batch.suppress):
            if ids:
                logits[row, ids] = -float("inf")
    out = torch.argmax(logits, dim=-1)
    if bool(batch.greedy.all()):
        return out.cpu().numpy()
    rows = (~batch.greedy).nonzero().squeeze(1)                             # rows that sample
    probs = torch.softmax(logits[rows] / batch.temperature[rows], dim=-1)  # [m, V]
    if batch.needs_filter:
        probs, order = _filtered_sorted(probs, rows.tolist(), batch)
    else:
        order = None
    u = torch.from_numpy(uniforms(batch.seeds, batch.streams, batch.positions)).to(logits.device)[rows]
    cdf = probs.double().cumsum(dim=-1)                                   # [m, V]
    target = u[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target).clamp_(max=vocab - 1).squeeze(1)
    if order is not None:
        idx = order.gather(1, idx[:, None]).squeeze(1)
    out[rows] = idx
    return out.cpu().numpy()


def _filtered_sorted(probs: torch.Tensor, rows: list[int], batch: SamplingBatch):
    """Sort each row descending and zero what top-k / top-p / min-p exclude (vLLM order: k, then p)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[1]
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    top_k = torch.tensor([batch.top_k[r] or vocab for r in rows], device=probs.device)[:, None]
    keep = ranks < top_k
    top_p = torch.tensor([batch.top_p[r] for r in rows], device=probs.device, dtype=probs.dtype)[:, None]
    kept = sorted_p * keep
    kept = kept / kept.sum(-1, keepdim=True)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
    before = kept.cumsum(-1) - kept
    keep &= before < top_p
    min_p = torch.tensor([batch.min_p[r] for r in rows], device=probs.device, dtype=probs.dtype)[:, None]
    keep &= sorted_p >= min_p * sorted_p[:, :1]
    keep[:, 0] = True
    return sorted_p * keep, order
