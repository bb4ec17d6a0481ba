"""Runs the model over a batch: prefill on the S-worker, decode with the R-part per layer.

Rows of a batch are ordered by R-worker so each worker's rows are one contiguous slice.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch

from fastdecode.engine.prefill_plan import PrefillPlan, chunk_context
from fastdecode.engine.prefix_cache import PrefixCache
from fastdecode.engine.sampler import (
    AllowedTokens,
    LogitBias,
    Penalties,
    SamplingBatch,
    logprobs_of,
    sample,
    token_logprobs,
)
from fastdecode.engine.sequence import Sequence
from fastdecode.engine.stats import PrefillPhases
from fastdecode.engine.token_masks import banned_tokens
from fastdecode.model.layer_graphs import LayerGraphs
from fastdecode.model.llama import LlamaSPart
from fastdecode.rpart.base import RBackend, StepStats, TorchWireLayout

PROMPT_LOGPROB_BLOCK = 1 << 24   # logits per LM-head block for prompt log-probabilities (64 MB fp32):
                                 # a 30k-token prompt never needs a [30k, V] tensor


def group_by_worker(seqs: list[Sequence], num_workers: int) -> tuple[list[Sequence], list[int]]:
    """Stable sort by worker -> (ordered sequences, rows per worker)."""
    ordered = sorted(seqs, key=lambda s: s.worker)
    counts = [0] * num_workers
    for s in ordered:
        counts[s.worker] += 1
    return ordered, counts


class ModelRunner:
    def __init__(self, model: LlamaSPart, backend: RBackend, eos_ids: frozenset[int], depth: int = 2,
                 graphs: LayerGraphs | None = None):
        self.model, self.backend = model, backend
        self.config = model.config
        self.depth = depth
        self.graphs = graphs            # CUDA graphs of the dense work between attentions (or None)
        self.device = model.device
        self.eos_ids = eos_ids
        self.last_s_time = 0.0          # S-worker compute (incl. waiting it could not hide), seconds
        self.last_r_wait = 0.0          # S-worker time blocked on R-worker replies
        self.last_rows = np.zeros((0, 2), np.int64)   # [B, (worker, position)] of the last decode's rows
        self.decode_rows = 0            # sequence-steps decoded (rows that crossed to the R-part)
        self.prefill_rows = 0           # prompt tokens whose K/V were shipped
        self.prefill_threads = 0        # torch threads for prefill (0: as decode), where the R-part idles
        self.prefill_cpus: list[int] = []   # CPUs for prefill, where the S-worker bound itself narrower
        self.last_prefill: PrefillPhases | None = None
        self.chunk_kv: dict[int, list] = {}   # seq id -> per layer (K, V) [p, Hkv, D] of the prompt chunks
                                              # prefilled so far, while more chunks are to come
        # KV tokens a new sequence reserves on its worker (the engine's placement), sent with its
        # prefill so the worker takes those pages at once: one run per (layer, head), not a page
        # wherever the free list has one every 32 decode steps (bench/kernel/NOTES.md, "Page runs")
        self.reserve_tokens: Callable[[Sequence], int] | None = None
        self.prefix: PrefixCache | None = None    # shared prompt prefixes: forks, kept prefix K/V

    def _static_sampling(self, s: Sequence) -> tuple:
        """What a sequence's sampling needs besides its position; fixed for its life, so cached."""
        p = s.request.params
        s.sampling_row = ((float(p.temperature), float(p.top_k), float(p.top_p), float(p.min_p),
                           float(p.min_tokens), float(p.penalized), float(-1 if p.logprobs is None else p.logprobs),
                           float(p.biased), float(p.masked)),
                          s.request.seed, s.sample_index)
        return s.sampling_row

    def _sampling_batch(self, seqs: list[Sequence], n_out: np.ndarray) -> SamplingBatch:
        """The rows' sampling parameters; n_out [n]: tokens each sequence has generated so far."""
        rows = [s.sampling_row or self._static_sampling(s) for s in seqs]
        n = len(rows)
        cols = np.array([r[0] for r in rows], dtype=np.float64).reshape(n, 9)
        #   [n, (temp, k, p, min_p, min_tokens, penalized, logprobs or -1, biased, masked)]
        suppress = {}
        for i in np.flatnonzero(n_out < cols[:, 4]):    # min_tokens: EOS/stop ids may not end it yet
            p = seqs[i].request.params
            suppress[int(i)] = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids))
        allowed = {}
        for i in np.flatnonzero(cols[:, 8] > 0):        # allowed_token_ids, bad_words
            s = seqs[i]
            if s.request.allowed_ids is not None:      # made once, at add_request
                allowed[int(i)] = s.request.allowed_ids
            banned = banned_tokens(s.request.bad_words_ids, s.output_ids)
            if banned:
                suppress.setdefault(int(i), []).extend(banned)
        batch = SamplingBatch.from_arrays(cols[:, :4], np.fromiter((r[1] for r in rows), np.uint64, n),
                                          np.fromiter((r[2] for r in rows), np.uint64, n), n_out, suppress,
                                          self.device)
        if allowed:
            batch.allowed = AllowedTokens.of(allowed)
        biased = np.flatnonzero(cols[:, 7] > 0)
        if biased.size:
            batch.bias = LogitBias.of({int(i): seqs[i].request.params.logit_bias for i in biased})
        penalized = np.flatnonzero(cols[:, 5] > 0)
        if penalized.size:
            batch.penalties = penalties_of([seqs[i] for i in penalized], penalized)
        batch.logprob_rows = np.flatnonzero(cols[:, 6] >= 0)
        batch.logprob_k = cols[batch.logprob_rows, 6].astype(np.int64)
        return batch

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, batch: SamplingBatch) -> np.ndarray:
        """Tokens [n] for `seqs` (row order); rows that asked for log-probabilities get them appended."""
        tokens = sample(logits, batch)
        lp = token_logprobs(logits, tokens, batch)
        if lp is not None:
            for j, row in enumerate(lp.rows.tolist()):
                s = seqs[row]
                k = s.request.params.logprobs
                s.logprobs.append((float(lp.chosen[j]), int(lp.rank[j]), lp.top_ids[j, :k], lp.top[j, :k]))
        return tokens

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> tuple[list[Sequence], np.ndarray]:
        """Prompt forward for `seqs`; their K/V go to their workers. -> (the new sequences in row order,
        their first tokens). A preempted sequence back from the queue has its prompt and all its output
        but the newest token prefilled (its KV recomputed) and samples nothing: decode goes on from there.
        Where the phases went is left in `last_prefill`."""
        return self._with_prefill_threads(self._prefill, seqs)

    def _with_prefill_threads(self, fn, *args):
        """fn(*args) on prefill's threads (and CPUs, where the S-worker bound itself to its share)."""
        threads, mask = torch.get_num_threads(), None
        if self.prefill_cpus:
            mask = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.prefill_cpus)      # OpenMP threads made now inherit it
        if self.prefill_threads and self.prefill_threads != threads:
            torch.set_num_threads(self.prefill_threads)
        try:
            return fn(*args)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            if mask is not None:
                os.sched_setaffinity(0, mask)

    def _prefill(self, seqs: list[Sequence]) -> tuple[list[Sequence], np.ndarray]:
        m, be = self.model, self.backend
        clock = time.perf_counter
        t_start = clock()
        pf = self._prefill_plan(seqs)
        t = clock()
        pf.begin(be, m.config.num_layers)
        handoff = clock() - t
        x = m.embed_tokens(pf.tokens)                                # [T, h]
        rope = m.rope.cos_sin(pf.positions)
        attention = 0.0
        for layer in range(m.config.num_layers):
            q, k, v = m.qkv(layer, x, rope)
            t = clock()
            be.prefill_layer(layer, k, v)                            # leaves while the next layer computes
            t1 = clock()
            o = m.prompt_attention(layer, q, k, v, pf.lengths, pf.context(layer, k, v))
            t2 = clock()
            x = m.post_attn(layer, x, o)
            handoff += t1 - t
            attention += t2 - t1
        t = clock()
        be.prefill_end()
        handoff += clock() - t
        result = self._prefill_finish(pf, x)
        ph = self.last_prefill = PrefillPhases(tokens=pf.rows, wall_s=clock() - t_start, s_attention_s=attention)
        ph.s_compute_s = ph.wall_s - handoff - attention
        ph.pack_s, ph.wait_s, ph.append_s = be.prefill_times.pack_s, be.prefill_times.wait_s, be.prefill_times.append_s
        return result

    def _prefill_plan(self, seqs: list[Sequence]) -> PrefillPlan:
        be = self.backend
        seqs, _ = group_by_worker(seqs, be.num_workers)
        # each sequence's chunk: KV positions start .. end-1 (the whole prompt unless chunked, or
        # from a shared prefix on: its member's first chunk forks the prefix on the worker)
        starts = [s.prefilled for s in seqs]
        ends = [s.prefill_to or s.kv_len for s in seqs]
        pf = PrefillPlan(seqs, starts, ends)
        pf.tokens = torch.tensor([t for s, b, e in zip(seqs, starts, ends) for t in self._chunk_tokens(s, b, e)],
                                 device=self.device)
        pf.positions = torch.cat([torch.arange(b, e, device=self.device) for b, e in zip(starts, ends)])
        pf.worker_rows = [sum(n for s, n in zip(seqs, pf.lengths) if s.worker == w) for w in range(be.num_workers)]
        forks = [self.prefix.take_fork(s) if self.prefix is not None else None for s in seqs]
        first = np.array([b == 0 or f is not None for b, f in zip(starts, forks)], dtype=bool)
        if self.reserve_tokens is not None and first.any():
            new = [s for s, f in zip(seqs, first) if f]
            held = np.array([self.reserve_tokens(s) for s in new], dtype=np.int64)
            pf.reserve = (pf.seq_ids[first], held, [sum(1 for s in new if s.worker == w)
                                                    for w in range(be.num_workers)])
        pf.continued = pf.seq_ids[~first]
        capture = self._prefix_hand_off(pf, forks)
        if any(starts) or not all(pf.done) or capture:
            pf.context_fn = chunk_context(self.chunk_kv, self.model.config.num_layers, seqs, starts, pf.lengths,
                                          pf.done, capture, self.prefix.keep if capture else None)
        return pf

    @staticmethod
    def _chunk_tokens(s: Sequence, start: int, end: int) -> list[int]:
        """The token ids at KV positions start .. end-1 of a sequence: its prompt, then its output
        but the newest token (a preempted sequence recomputes those)."""
        return (s.request.prompt_ids + s.output_ids[:-1])[start:end]

    @staticmethod
    def _decode_meta(seqs: list[Sequence]) -> np.ndarray:
        """[B, (seq id, worker, kv_len = position, last token, tokens generated)] of the decode rows."""
        return np.array([(s.seq_id, s.worker, s.prompt_len + len(s.output_ids) - 1, s.output_ids[-1],
                          len(s.output_ids)) for s in seqs], dtype=np.int64).reshape(-1, 5)

    def _prefix_hand_off(self, pf: PrefillPlan, forks: list) -> dict[int, int]:
        """Shared prefixes in this prefill: each member's fork (sent to its worker) and the prefix
        K/V its chunk attends to (as an earlier chunk's); -> {row of a donor: prefix tokens whose K/V
        to keep}."""
        if self.prefix is None:
            return {}
        members = [i for i, f in enumerate(forks) if f is not None]
        for i in members:
            self.chunk_kv[pf.seqs[i].seq_id] = forks[i].kv
        if members:
            pf.forks = (pf.seq_ids[members], np.array([forks[i].source for i in members], np.int64),
                        np.array([forks[i].tokens for i in members], np.int64),
                        np.bincount([pf.seqs[i].worker for i in members],
                                    minlength=self.backend.num_workers).tolist())
        return {i: t for i, s in enumerate(pf.seqs) if (t := self.prefix.capture_tokens(s))}

    def _prefill_finish(self, pf: PrefillPlan, x: torch.Tensor) -> tuple[list[Sequence], np.ndarray]:
        """After the last layer (x [T, h]): sample the first token of each fresh sequence whose
        prompt ended in this step. -> (those sequences, their tokens)"""
        self.prefill_rows += pf.rows
        for s, e, d in zip(pf.seqs, pf.ends, pf.done):
            s.prefilled, s.prefill_to = (0 if d else e), 0
        fresh = [i for i, s in enumerate(pf.seqs) if pf.done[i] and not s.output_ids]
        if not fresh:
            return [], np.zeros(0, np.int64)
        seqs, rows_end = [pf.seqs[i] for i in fresh], np.cumsum(pf.lengths)[fresh]   # the row after each one's last
        self._prompt_logprobs(seqs, rows_end.tolist(), x)
        last = torch.tensor(rows_end - 1, device=self.device)
        logits = self.model.logits(x[last])                          # [n, V]
        return seqs, self._sample(seqs, logits, self._sampling_batch(seqs, np.zeros(len(seqs), dtype=np.int64)))

    def forget(self, seqs: list[Sequence]) -> None:
        """Drop what a chunked prefill kept of these sequences (freed before their last chunk)."""
        for s in seqs:
            self.chunk_kv.pop(s.seq_id, None)
            s.prefilled = s.prefill_to = 0

    def _prompt_logprobs(self, seqs: list[Sequence], ends: list[int], x: torch.Tensor) -> None:
        """For requests that asked (once per request, by its first sample): the log-probability of each
        prompt token after the first given the ones before it, from the last layer's x [T, h];
        sequence i's prompt rows end before row ends[i]."""
        m = self.model
        block = max(1, PROMPT_LOGPROB_BLOCK // m.config.vocab_size)
        for s, end in zip(seqs, ends):
            k = s.request.params.prompt_logprobs
            if k is None or s.sample_index != 0:
                continue
            start, n = end - s.prompt_len, s.prompt_len - 1        # rows start .. start+n-1 predict tokens 1..n
            targets = torch.tensor(s.request.prompt_ids[1:], dtype=torch.int64, device=self.device)   # [n]
            parts = [logprobs_of(m.logits(x[start + i: start + min(i + block, n)]), targets[i: i + block], k)
                     for i in range(0, n, block)]
            empty = (np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros((0, k), np.int64),
                     np.zeros((0, k), np.float32))
            s.request.prompt_logprobs = tuple(np.concatenate(col) for col in zip(*parts)) if parts else empty

    def mixed(self, decode: list[Sequence], prefill: list[Sequence]):
        """A chunked-prefill step (_mixed), on prefill's threads: the R-part's share of it is short."""
        return self._with_prefill_threads(self._mixed, decode, prefill)

    @torch.inference_mode()
    def _mixed(self, decode: list[Sequence], prefill: list[Sequence]):
        """One step of decode rows and prompt chunks through the same dense layers (chunked prefill).

        x = [decode rows | prompt rows]; per layer one QKV projection for both, then the decode
        rows leave for the R-workers while the S-worker attends the prompt rows itself (their
        K/V leave too), then one MLP for both:
            for layer: qkv = proj(x); submit(decode rows); send(prompt K/V); o_p = attend(prompt rows)
                       o_d = wait(decode rows); x = post_attn(x, [o_d | o_p])
        -> ((fresh sequences whose prompt ended, their first tokens), (decode seqs in row order,
        their tokens, R-side stats)). Phases of the prompt part are left in `last_prefill`."""
        m, be, c = self.model, self.backend, self.config
        clock = time.perf_counter
        t_start = clock()
        pf = self._prefill_plan(prefill)
        # the decode rows: one mini-batch, by worker then seq id (the prompt rows fill the pipeline)
        meta = self._decode_meta(decode)       # [B, (seq id, worker, position, last token, generated)]
        order = np.lexsort((meta[:, 0], meta[:, 1]))
        meta, dseqs = meta[order], [decode[i] for i in order]
        counts = np.bincount(meta[:, 1], minlength=be.num_workers).tolist()
        layout = TorchWireLayout(counts, c.num_heads, c.num_kv_heads, c.head_dim)
        layout.row_offsets(self.device)
        n = len(dseqs)
        rope_d = m.rope.cos_sin(torch.from_numpy(meta[:, 2]).to(self.device), int(meta[:, 2].max()))
        rope_p = m.rope.cos_sin(pf.positions)
        sampling = self._sampling_batch(dseqs, meta[:, 4])
        x = torch.cat([m.embed_tokens(torch.from_numpy(meta[:, 3]).to(self.device)),
                       m.embed_tokens(pf.tokens)])                                    # [B + T, h]
        t = clock()
        be.decode_begin([(meta[:, 0].copy(), counts)], c.num_layers, mixed=[r > 0 for r in pf.worker_rows])
        pf.begin(be, c.num_layers)
        handoff, attention, r_wait = clock() - t, 0.0, 0.0
        for layer in range(c.num_layers):
            qkv = m.qkv_proj(layer, x)                                                # [B + T, (Hq + 2 Hkv) D]
            t = clock()
            out = be.decode_buffer(layer, 0, layout.numel(), self.device, m.dtype)
            m.rope_pack(layer, qkv[:n], rope_d, layout, out)
            be.decode_submit(layer, 0, out)
            q, k, v = m.rope_split(layer, qkv[n:], rope_p)
            t1 = clock()
            be.prefill_layer(layer, k, v)
            t2 = clock()
            o_p = m.prompt_attention(layer, q, k, v, pf.lengths, pf.context(layer, k, v))   # [T, Hq, D]
            t3 = clock()
            o_d = be.decode_wait(layer, 0)                                            # [B, Hq, D]
            t4 = clock()
            x = m.post_attn(layer, x, torch.cat([o_d.to(o_p.dtype), o_p]))
            handoff += t2 - t1
            attention += t3 - t2
            r_wait += t4 - t3
        t = clock()
        be.prefill_end()
        handoff += clock() - t
        tokens = self._sample(dseqs, m.logits(x[:n]), sampling)
        stats = be.decode_end()
        first = self._prefill_finish(pf, x[n:])
        self.decode_rows += n
        self.last_r_wait = r_wait
        wall = clock() - t_start
        self.last_s_time = wall - r_wait
        ph = self.last_prefill = PrefillPhases(tokens=pf.rows, wall_s=wall, s_attention_s=attention, mixed=True)
        ph.s_compute_s = wall - handoff - attention - r_wait
        ph.pack_s, ph.wait_s, ph.append_s = be.prefill_times.pack_s, be.prefill_times.wait_s, be.prefill_times.append_s
        return first, (dseqs, tokens, stats)

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
        c = m.config
        # 1. host bookkeeping: one pass over the sequences, the rest numpy (B can be 16k rows), and
        #    every upload before the first kernel (the device is idle: the last step ended by
        #    reading its tokens), so nothing later makes the host wait for queued kernels
        meta = self._decode_meta(seqs)         # [B, (seq id, worker, position, last token, generated)]
        self.last_rows = meta[:, 1:3]
        plans = []                           # per mini-batch: (sequences, rows per worker, seq ids, rows of meta)
        for rows in split_by_r_load(meta[:, 2], meta[:, 0], self.depth):
            rows = rows[np.lexsort((meta[rows, 0], meta[rows, 1]))]          # by worker, then seq id
            counts = np.bincount(meta[rows, 1], minlength=be.num_workers).tolist()
            plans.append(([seqs[i] for i in rows], counts, meta[rows, 0].copy(), rows))
        layouts, xs, rope, sampling = [], [], [], []
        for part, counts, _, rows in plans:
            layouts.append(TorchWireLayout(counts, c.num_heads, c.num_kv_heads, c.head_dim))
            layouts[-1].row_offsets(self.device)
            xs.append(m.embed_tokens(torch.from_numpy(meta[rows, 3]).to(self.device)))          # [n_mb, h]
            rope.append(m.rope.cos_sin(torch.from_numpy(meta[rows, 2]).to(self.device), int(meta[rows, 2].max())))
            sampling.append(self._sampling_batch(part, meta[rows, 4]))
        graphs = self.graphs if self.graphs is not None and all(self.graphs.fits(len(p[0])) for p in plans) \
            else None
        if graphs is not None:          # the residual streams live in the graphs' static buffers
            xs = [graphs.begin(mb, x) for mb, x in enumerate(xs)]
        t0 = time.perf_counter()
        r_wait = 0.0
        be.decode_begin([(ids, counts) for _, counts, ids, _ in plans], c.num_layers)

        def submit(layer: int, mb: int, qkv: torch.Tensor | None = None) -> None:
            # q|k|v of one mini-batch, straight into the wire layout (qkv: projections already made)
            out = be.decode_buffer(layer, mb, layouts[mb].numel(), self.device, m.dtype)
            if qkv is None:
                m.qkv_packed(layer, xs[mb], rope[mb], layouts[mb], out)
            else:
                m.rope_pack(layer, qkv, rope[mb], layouts[mb], out)
            be.decode_submit(layer, mb, out)

        # 2. the layers: while the R-workers attend one mini-batch the S-part runs another
        for mb in range(len(plans)):
            submit(0, mb)
        last = c.num_layers - 1
        sampled = []
        for layer in range(c.num_layers):
            for mb in range(len(plans)):
                tw = time.perf_counter()
                o = be.decode_wait(layer, mb)                              # [n_mb, Hq, D]
                r_wait += time.perf_counter() - tw
                if graphs is not None:     # post_attn(layer) + projections of layer + 1: one replay
                    qkv = graphs.layer(layer, mb, o)
                else:
                    xs[mb], qkv = m.post_attn(layer, xs[mb], o), None
                if layer < last:
                    submit(layer + 1, mb, qkv)
                else:   # this mini-batch's LM head and sampling run while the R-workers attend the next
                    sampled.append(self._sample(plans[mb][0], m.logits(xs[mb]), sampling[mb]))    # [n_mb]
        ordered = [s for part, _, _, _ in plans for s in part]
        next_tokens = np.concatenate(sampled) if len(sampled) > 1 else sampled[0]
        stats = be.decode_end()
        self.decode_rows += len(ordered)
        self.last_r_wait = r_wait
        self.last_s_time = time.perf_counter() - t0 - r_wait
        return ordered, next_tokens, stats


def penalties_of(seqs: list[Sequence], rows: np.ndarray) -> Penalties:
    """The penalty inputs of `seqs` (rows [m] of the batch): their generated tokens, and the prompt
    tokens of those with a repetition penalty (it counts the prompt too)."""
    params = [s.request.params for s in seqs]
    outs = [np.asarray(s.output_ids, np.int64) for s in seqs]
    prompts = [np.asarray(s.request.prompt_ids if p.repetition_penalty != 1 else (), np.int64)
               for s, p in zip(seqs, params)]
    idx = np.arange(len(seqs))
    return Penalties(rows, [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                     [p.repetition_penalty for p in params],
                     np.repeat(idx, [len(o) for o in outs]), np.concatenate(outs),
                     np.repeat(idx, [len(q) for q in prompts]), np.concatenate(prompts))


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
