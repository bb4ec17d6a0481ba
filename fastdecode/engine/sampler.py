"""Batched sampling with vLLM's semantics and per-sequence, batch-independent randomness.

Each sampled row draws its uniform from a counter-based hash of (seed, sample index, output
position), and turns it into a token by an inverse CDF over an order fixed by its own parameters
(the vocabulary's, or probability-sorted where it filters with top-k/top-p/min-p), so a request's
tokens depend only on its logits, parameters and seed: never on what else is in the batch, on
scheduling, or on the number of R-workers.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

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
    """Per-row sampling parameters of one batch: host arrays, and device tensors only for rows that
    sample. Whether a row samples is decided on the host, so a greedy batch never waits for the
    device before its argmax is read."""

    __slots__ = ("top_k", "top_p", "min_p", "needs_filter", "filter_rows", "seeds", "streams", "positions", "suppress",
                 "sample_rows", "sample_rows_dev", "temperature", "allowed", "bias", "penalties", "logprob_rows",
                 "logprob_k")

    def __init__(self, rows, device):
        # rows: list of (SamplingParams, seed:int, stream:int, position:int, suppress_ids:list[int]|None)
        n = len(rows)
        cols = np.array([(p.temperature, p.top_k, p.top_p, p.min_p) for p, *_ in rows],
                        dtype=np.float64).reshape(n, 4)
        self._fill(cols, np.fromiter((r[1] for r in rows), np.uint64, n),
                   np.fromiter((r[2] for r in rows), np.uint64, n), np.fromiter((r[3] for r in rows), np.uint64, n),
                   {i: r[4] for i, r in enumerate(rows) if r[4]}, device)

    @classmethod
    def from_arrays(cls, cols: np.ndarray, seeds: np.ndarray, streams: np.ndarray, positions: np.ndarray,
                    suppress: dict[int, list[int]], device) -> "SamplingBatch":
        """cols: [n, 4] float64 (temperature, top_k, top_p, min_p); seeds/streams/positions: [n];
        suppress: row -> token ids that may not be sampled (min_tokens, bad_words)."""
        batch = cls.__new__(cls)
        batch._fill(cols, seeds.astype(np.uint64), streams.astype(np.uint64), positions.astype(np.uint64),
                    suppress, device)
        return batch

    def _fill(self, cols, seeds, streams, positions, suppress, device):
        temperature = cols[:, 0].astype(np.float32)     # greedy or sampled: decided in the type it divides in
        self.sample_rows = np.flatnonzero(temperature != 0)                  # [m] rows that sample
        self.top_k = cols[:, 1].astype(np.int64)
        self.top_p, self.min_p = cols[:, 2], cols[:, 3]
        picked = self.sample_rows
        filters = (self.top_k[picked] > 0) | (self.top_p[picked] < 1) | (self.min_p[picked] > 0)
        self.filter_rows = np.flatnonzero(filters)     # [f] of the m sampling rows: those that filter
        self.needs_filter = bool(self.filter_rows.size)
        self.seeds, self.streams, self.positions = seeds, streams, positions
        self.suppress = suppress
        self.allowed = None                            # AllowedTokens, set by the caller for rows that have them
        self.bias = None                               # LogitBias, set by the caller for rows that have one
        self.penalties = None                          # Penalties, set by the caller for rows that have them
        self.logprob_rows = np.zeros(0, np.int64)      # [r] rows that return log-probabilities
        self.logprob_k = np.zeros(0, np.int64)         # [r] top alternatives each wants
        if self.sample_rows.size:
            device = torch.device(device)
            self.sample_rows_dev = torch.from_numpy(self.sample_rows).to(device)
            self.temperature = torch.from_numpy(temperature[self.sample_rows]).to(device)[:, None]
        else:
            self.sample_rows_dev = self.temperature = None


class LogitBias:
    """OpenAI's logit_bias for some rows: rows, ids, values [t], one entry per (row, biased token)."""

    def __init__(self, rows, ids, values):
        self.rows = np.asarray(rows, np.int64)
        self.ids = np.asarray(ids, np.int64)
        self.values = np.asarray(values, np.float32)

    @classmethod
    def of(cls, biases: dict[int, dict[int, float]]) -> "LogitBias":
        """biases: row -> {token id: bias}."""
        rows = [r for r, b in biases.items() for _ in b]
        return cls(rows, [t for b in biases.values() for t in b], [v for b in biases.values() for v in b.values()])

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [n, V]; each (row, token) pair occurs once, so no accumulation is needed."""
        dev = logits.device
        rows, ids = torch.from_numpy(self.rows).to(dev), torch.from_numpy(self.ids).to(dev)
        logits[rows, ids] += torch.from_numpy(self.values).to(dev, logits.dtype)


class AllowedTokens:
    """vLLM's allowed_token_ids for some rows: every other token of those rows is masked.
    urows [u]: the rows; local [t], ids [t]: one entry per (row, allowed token), the row as an index
    into urows. Built from each request's id array (made once per request) with array operations:
    a step costs no Python work per allowed id."""

    def __init__(self, urows, local, ids):
        self.urows = np.asarray(urows, np.int64)
        self.local = np.asarray(local, np.int64)
        self.ids = np.asarray(ids, np.int64)
        self.row_set = frozenset(self.urows.tolist())

    @classmethod
    def of(cls, allowed: dict[int, np.ndarray | list[int]]) -> "AllowedTokens":
        """allowed: row -> token ids it may generate (an int64 array, or a list)."""
        arrays = [np.asarray(ids, np.int64) for ids in allowed.values()]
        sizes = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
        ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        return cls(np.fromiter(allowed, np.int64, len(allowed)), np.repeat(np.arange(len(arrays)), sizes), ids)

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [n, V]: -inf outside each row's allowed ids."""
        dev = logits.device
        urows_dev = torch.from_numpy(self.urows).to(dev)                       # [u]
        local, ids = torch.from_numpy(self.local).to(dev), torch.from_numpy(self.ids).to(dev)   # [t], [t]
        sub = logits[urows_dev]                                                 # [u, V]
        kept = torch.full_like(sub, -float("inf"))
        kept[local, ids] = sub[local, ids]
        logits[urows_dev] = kept


class Penalties:
    """vLLM's presence, frequency and repetition penalties for some rows of a batch.

    rows [m]: the penalized rows; presence, frequency, repetition [m]; out_rows/out_ids [t]: one
    entry per generated token of those rows (row as an index into `rows`); seen_rows/seen_ids:
    the same for prompt tokens of rows with a repetition penalty."""

    def __init__(self, rows, presence, frequency, repetition, out_rows, out_ids, seen_rows, seen_ids):
        self.rows = np.asarray(rows, np.int64)
        self.presence = np.asarray(presence, np.float32)
        self.frequency = np.asarray(frequency, np.float32)
        self.repetition = np.asarray(repetition, np.float32)
        self.out_rows, self.out_ids = np.asarray(out_rows, np.int64), np.asarray(out_ids, np.int64)
        self.seen_rows, self.seen_ids = np.asarray(seen_rows, np.int64), np.asarray(seen_ids, np.int64)

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [n, V]: repetition first, then frequency and presence (vLLM's order).
        Only the (row, token) pairs in the histories are read and written: O(tokens), not O(rows x V)
        (bench/e2e/penalty_bench.py: 8x faster than dense [rows, V] tables at 1,024 rows, V = 49,152)."""
        dev, vocab = logits.device, logits.shape[1]
        on_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)      # noqa: E731
        rows = on_dev(self.rows)                                                   # [m] rows of logits
        flat = logits.view(-1)
        keys, counts = torch.unique(on_dev(self.out_rows * vocab + self.out_ids), return_counts=True)
        #   keys [u]: distinct (penalized row j, token) as j * V + token; counts [u]: occurrences
        if (self.repetition != 1).any():
            seen = torch.unique(torch.cat([keys, on_dev(self.seen_rows * vocab + self.seen_ids)]))
            j = seen // vocab
            at = rows[j] * vocab + seen % vocab
            x, r = flat[at], on_dev(self.repetition)[j]
            flat[at] = torch.where(x > 0, x / r, x * r)
        if keys.numel():
            j = keys // vocab
            at = rows[j] * vocab + keys % vocab
            flat[at] -= on_dev(self.frequency)[j] * counts.to(flat.dtype) + on_dev(self.presence)[j]


class TokenLogprobs(NamedTuple):
    """Log-probabilities of chosen tokens at some rows (numpy, k = the most any row asked for)."""
    rows: np.ndarray        # [r] rows of the batch
    chosen: np.ndarray      # [r] float32: the chosen token's
    rank: np.ndarray        # [r] its rank (1 = most likely)
    top_ids: np.ndarray     # [r, k] the k most likely tokens
    top: np.ndarray         # [r, k] ... and their log-probabilities


def logprobs_of(logits: torch.Tensor, picked: torch.Tensor, k: int) -> tuple[np.ndarray, ...]:
    """logits [r, V], picked [r] token ids -> (chosen [r], rank [r], top ids [r, k], top [r, k]) of the
    raw distribution log_softmax(logits), as numpy."""
    lp = torch.log_softmax(logits.float(), dim=-1)                                # [r, V]
    chosen = lp.gather(1, picked[:, None])                                        # [r, 1]
    rank = _count_greater(lp, chosen) + 1
    top, top_ids = lp.topk(k, dim=-1)                                             # [r, k] (k may be 0)
    return chosen[:, 0].cpu().numpy(), rank.cpu().numpy(), top_ids.cpu().numpy(), top.cpu().numpy()


def _count_greater(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Per row of x [r, V], how many entries exceed threshold [r, 1]. On the CPU in numpy: in a
    profile of bench/e2e/prompt_logprobs_bench.py, PyTorch's CPU sum of the bool tensor cost more than
    the log_softmax itself."""
    if x.device.type == "cpu":
        return torch.from_numpy((x.numpy() > threshold.numpy()).view(np.uint8).sum(-1, dtype=np.int64))
    return (x > threshold).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: np.ndarray, batch: SamplingBatch) -> TokenLogprobs | None:
    """The raw model distribution's log-probabilities (before penalties, temperature and filters,
    as vLLM returns them) of `tokens` [n] for the rows that asked; None if none did."""
    if not batch.logprob_rows.size:
        return None
    rows = torch.from_numpy(batch.logprob_rows).to(logits.device)
    picked = torch.from_numpy(tokens[batch.logprob_rows]).to(logits.device)
    return TokenLogprobs(batch.logprob_rows, *logprobs_of(logits[rows], picked, int(batch.logprob_k.max())))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> np.ndarray:
    """logits: [n, V] float32 -> token ids int64 [n] (numpy). `logits` itself is left as it is."""
    if batch.suppress or batch.allowed is not None or batch.bias is not None or batch.penalties is not None:
        logits = logits.clone()
    if batch.allowed is not None:        # vLLM's order: allowed_token_ids, bad_words, min_tokens, logit_bias,
        batch.allowed.apply(logits)      # penalties (the masks commute with the rest: -inf stays -inf)
    if batch.suppress:                   # min_tokens: EOS/stop ids may not end the sequence yet; bad_words
        both = [r for r in batch.suppress if r in batch.allowed.row_set] if batch.allowed is not None else []
        allowed_only = logits[both].clone() if both else None                  # [b, V]
        for row, ids in batch.suppress.items():
            logits[row, ids] = -float("inf")
        if both:                         # bans that leave none of a row's allowed tokens are lifted for
            dead = torch.isneginf(logits[both]).all(-1)     # the step: allowed_token_ids wins
            if bool(dead.any()):
                rows = torch.tensor(both, device=logits.device)[dead]
                logits[rows] = allowed_only[dead]
    if batch.bias is not None:
        batch.bias.apply(logits)
    if batch.penalties is not None:
        batch.penalties.apply(logits)
        logits.clamp_(max=torch.finfo(logits.dtype).max)      # a penalty past float32's range: its largest
    out = torch.argmax(logits, dim=-1)
    if not batch.sample_rows.size:
        return out.cpu().numpy()
    rows = batch.sample_rows_dev                                             # rows that sample
    scaled = logits[rows]                                                    # [m, V]
    # less each row's maximum before the division: a tiny temperature then sends every other token to
    # -inf (the greedy limit) where logits / T would overflow to inf and the softmax to NaN
    probs = torch.softmax((scaled - scaled.amax(dim=-1, keepdim=True)) / batch.temperature, dim=-1)
    pick = batch.sample_rows
    u = torch.from_numpy(uniforms(batch.seeds[pick], batch.streams[pick], batch.positions[pick])).to(logits.device)
    # a row's draw walks its own order: the vocabulary's, or probability-sorted where it filters;
    # which order never depends on the other rows, so a draw is the same in any batch
    if batch.filter_rows.size == pick.size:
        out[rows] = _filtered_draw(probs, u, pick, batch)
    elif batch.needs_filter:
        f = torch.from_numpy(batch.filter_rows).to(logits.device)
        plain = torch.from_numpy(np.setdiff1d(np.arange(pick.size), batch.filter_rows)).to(logits.device)
        out[rows[f]] = _filtered_draw(probs[f], u[f], pick[batch.filter_rows], batch)
        out[rows[plain]] = _inverse_cdf(probs[plain], u[plain])
    else:
        out[rows] = _inverse_cdf(probs, u)
    return out.cpu().numpy()


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [m, V] (unnormalized), u [m] in [0, 1) -> the column [m] where each row's CDF reaches u."""
    cdf = probs.double().cumsum(dim=-1)                                   # [m, V]
    target = u[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).clamp_(max=probs.shape[1] - 1).squeeze(1)


def _filtered_draw(probs: torch.Tensor, u: torch.Tensor, rows: np.ndarray, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [m] drawn from probs [m, V] of batch rows `rows` after their top-k/top-p/min-p."""
    kept, order = _filtered_sorted(probs, rows, batch)
    return order.gather(1, _inverse_cdf(kept, u)[:, None]).squeeze(1)


def _filtered_sorted(probs: torch.Tensor, rows: np.ndarray, batch: SamplingBatch):
    """Sort each row descending and zero what top-k / top-p / min-p exclude (vLLM order: k, then p)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[1]
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    k = batch.top_k[rows]
    top_k = torch.from_numpy(np.where(k == 0, vocab, k)).to(probs.device)[:, None]
    keep = ranks < top_k
    top_p = torch.from_numpy(batch.top_p[rows]).to(device=probs.device, dtype=probs.dtype)[:, None]
    kept = sorted_p * keep
    kept = kept / kept.sum(-1, keepdim=True)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
    before = kept.cumsum(-1) - kept
    keep &= before < top_p
    min_p = torch.from_numpy(batch.min_p[rows]).to(device=probs.device, dtype=probs.dtype)[:, None]
    keep &= sorted_p >= min_p * sorted_p[:, :1]
    keep[:, 0] = True
    return sorted_p * keep, order
