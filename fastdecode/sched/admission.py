"""Admission control: how many queued requests start decoding at this step.

The engine calls `admit(step, waiting, running, capacity_tokens)` once per decode step and
admits `waiting[:k]`. Both controllers keep FIFO order (a prefix is admitted or nothing), so a
request can only wait for those ahead of it and nobody starves.

Workload = total KV tokens the R-workers hold during a step; R-part time is proportional to it.
Conventions shared with the engine (fastdecode/sched/scheduler.py):
- waiting[i] = (prompt_len, max_tokens), FIFO order.
- running[i] = (kv_tokens_now, tokens_left_at_most[, tokens_generated]): KV tokens held before
  this step's decode, how many more decode steps the sequence may run (its max_tokens bound;
  EOS may come sooner), and optionally how many tokens it has generated (its age, which the
  learnt length model needs).
- A controller with `observe_finished(generated, stopped)` is told of every finished sequence:
  tokens generated, and whether it stopped at EOS/stop (True) or at max_tokens (False).
- A running sequence holds kv + t + 1 tokens during step now+t (one appended per step) while
  t < left. An admitted request (p, m) is projected as running (p, m): at most p + m tokens,
  one step more than an engine that samples the first token at prefill needs (an upper bound).
"""
from __future__ import annotations

import math
from itertools import islice
from typing import Sequence

import numpy as np

from fastdecode.sched.length_model import LengthModel

HEAD_WINDOW = 4096     # queued requests looked at for the S / prompt estimates (the next to start)


def projected_workload(kv: np.ndarray, left: np.ndarray, horizon: int | None = None) -> np.ndarray:
    """W[t] = sum_i (kv_i + t + 1) * [t < left_i]: KV tokens held during step now+t if all
    sequences run to their bound and nothing new starts. Returns [horizon] float64 (tokens)."""
    kv = np.asarray(kv, dtype=np.float64)
    left = np.clip(np.asarray(left, dtype=np.int64), 0, None)
    if horizon is None:
        horizon = int(left.max()) if left.size else 0
    if horizon <= 0:
        return np.zeros(0)
    r = np.minimum(left, horizon)
    # sequences still alive at t: those with left > t; difference arrays over their end steps
    ended = np.cumsum(np.bincount(r, minlength=horizon + 1))[:horizon]
    ended_kv = np.cumsum(np.bincount(r, weights=kv + 1.0, minlength=horizon + 1))[:horizon]
    alive = left.size - ended
    base = (kv + 1.0).sum() - ended_kv
    return base + np.arange(horizon) * alive


def peak_with(w_run: np.ndarray, new: np.ndarray, offset: int = 0) -> float:
    """Peak of the running projection shifted by `offset` steps plus a new curve starting now."""
    tail = w_run[offset:]
    n = max(tail.size, new.size)
    total = np.zeros(n)
    total[:tail.size] += tail
    total[:new.size] += new
    return float(total.max()) if n else 0.0


def largest_prefix(w_run: np.ndarray, items: np.ndarray, w_lim: float, k_max: int) -> int:
    """Largest k <= k_max such that running + items[:k] keep the projection <= w_lim.
    Adding a request only raises the curve, so feasibility is monotone in k: binary search."""
    lo, hi = 0, min(k_max, len(items))
    if hi <= 0 or (w_run.size and w_run.max() > w_lim):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        new = projected_workload(items[:mid, 0], items[:mid, 1])
        if peak_with(w_run, new) <= w_lim:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _grid(horizon: int, dense: int = 32, coarse: int = 128) -> np.ndarray:
    """Steps at which an expected projection is evaluated: every step up to `dense`, then
    `coarse` evenly spaced ones. The expected curve is smooth, so the grid misses its peak by
    at most (steps between points) x (sequences), a few percent of the load."""
    if horizon <= dense + coarse:
        return np.arange(max(horizon, 0))
    return np.unique(np.concatenate([np.arange(dense), np.linspace(dense, horizon - 1, coarse).astype(np.int64)]))


def largest_prefix_expected(lengths: LengthModel, run: np.ndarray, items: np.ndarray,
                            w_lim: float, k_max: int) -> int:
    """largest_prefix for the expected projection: run [n, 3] (kv, left, generated), items
    [k, 2] (prompt, max_tokens). All prefixes at once: each candidate adds a nonnegative curve,
    so the cumulative sum over candidates gives every prefix's projection."""
    k_max = min(k_max, len(items))
    if k_max <= 0:
        return 0
    new = items[:k_max]
    horizon = int(max(run[:, 1].max(initial=0), new[:, 1].max()))
    t = _grid(horizon)
    w_run = lengths.expected_curve(run[:, 0], run[:, 2], run[:, 1], t)                  # [J]
    if w_run.size and w_run.max() > w_lim:
        return 0
    curves = ((new[:, :1] + 1 + t[None, :]) * lengths.survival(t)[None, :]
              * (t[None, :] < new[:, 1:2]))                                          # [k, J]
    peaks = (np.cumsum(curves, axis=0) + w_run[None, :]).max(axis=1)                 # [k]
    return int(np.searchsorted(peaks > w_lim, True))      # peaks rise with k: first infeasible


def as_pairs(rows: Sequence[tuple[int, ...]], limit: int | None = None) -> np.ndarray:
    """[n, 2] int64 from the first two fields; only the first `limit` rows (a long queue is not
    converted every step)."""
    return _as_rows(rows, limit)[:, :2]


def _as_rows(rows: Sequence[tuple[int, ...]], limit: int | None = None) -> np.ndarray:
    """[n, c] int64, c = the rows' width (2 when there are none)."""
    if isinstance(rows, np.ndarray):              # an array's head is a view (the simulator's queue)
        arr = (rows if limit is None else rows[:limit]).astype(np.int64, copy=False)
        return arr if arr.ndim == 2 else arr.reshape(-1, 2)
    rows = rows if limit is None else list(islice(rows, limit))
    arr = np.asarray(rows, dtype=np.int64)
    return arr if arr.ndim == 2 else arr.reshape(-1, 2)


class FifoAdmission:
    """Baseline: admit from the queue head while fewer than max_batch sequences run (vLLM-like
    continuous batching without preemption). With capacity_tokens it also keeps the worst-case
    projection within capacity, since nothing can be preempted later."""

    def __init__(self, max_batch: int, worst_case: bool = True):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.max_batch = max_batch
        self.worst_case = worst_case    # False under --kv-reserve grow: preemption bounds memory instead
        self._capacity: float | None = None

    def admit(self, step: int, waiting: Sequence[tuple[int, int]],
              running: Sequence[tuple[int, int]], capacity_tokens: float | None = None) -> int:
        if not self.worst_case:
            capacity_tokens = None
        self._capacity = capacity_tokens
        k = max(0, min(len(waiting), self.max_batch - len(running)))
        if k and capacity_tokens is not None:
            run = as_pairs(running)
            w_run = projected_workload(run[:, 0], run[:, 1])
            k = largest_prefix(w_run, as_pairs(waiting, k), capacity_tokens, k)
        if k == 0 and len(waiting) and not len(running):
            k = 1       # a request too big for capacity alone is the engine's to reject; never deadlock
        return k

    def describe(self) -> dict:
        return {"schedule": "fifo", "max_batch": self.max_batch, "w_lim": self._capacity}

def spread_batch(target: int, max_gen: int, lifetime: int, prompt_mean: float,
                 capacity_tokens: float | None = None, seq_overhead: float = 0.0,
                 admit_every: int | None = None) -> tuple[int, int, int]:
    """(B, M, F): the batch the stabilized schedule spreads, its micro-batch and admission period.

    M = B*F/lifetime sequences every F steps (F defaults to lifetime/16) keeps B running with
    ages spread evenly; the workload then peaks at B*(prompt + (S+F)/2), plus `seq_overhead`
    per sequence in memory. When `capacity_tokens` holds fewer than `target` at that peak, the
    count that fits is spread instead (memory_batch)."""
    F = admit_every or _default_period(lifetime)
    if capacity_tokens is not None and _fit(capacity_tokens, max_gen, F, prompt_mean, seq_overhead) < target:
        return memory_batch(capacity_tokens, max_gen, lifetime, prompt_mean, seq_overhead, admit_every)
    return target, max(1, round(target * F / lifetime)), F


def memory_batch(capacity_tokens: float, max_gen: int, lifetime: int, prompt_mean: float,
                 seq_overhead: float = 0.0, admit_every: int | None = None) -> tuple[int, int, int]:
    """(B, M, F) for memory that holds fewer than the asked-for batch. Micro-batches sized for a
    B that cannot run open slots faster than sequences finish; the projection then refuses
    them, and the refused ones start together later: a few groups of one age instead of evenly
    spread ages, and fewer running (bench/sizing/reserve_capacity_bench.py). So: M for the B
    that fits, F set so that M per F steps opens at least B slots per lifetime, and B no more
    than that rate sustains (a ramp that kept opening slots past it made lumps too).
    `fastdecode plan` prices --kv-reserve grow with this."""
    F = admit_every or _default_period(lifetime)
    B = max(1, _fit(capacity_tokens, max_gen, F, prompt_mean, seq_overhead))
    M = max(1, round(B * F / lifetime))
    if admit_every is None:
        F = max(1, math.floor(M * lifetime / B))        # M per F steps: at least B per lifetime
    fit = _fit(capacity_tokens, max_gen, F, prompt_mean, seq_overhead)   # F moved the ripple
    return max(1, min(B, fit, math.floor(M * lifetime / F))), M, F


def _default_period(lifetime: int) -> int:
    """F when not given: 16 micro-batches per lifetime."""
    return max(1, math.ceil(lifetime / 16))


def _fit(capacity_tokens: float, max_gen: int, admit_every: int, prompt_mean: float, seq_overhead: float) -> int:
    """Sequences whose schedule peak, prompt + (S+F)/2 tokens each plus the overhead, fits."""
    return math.floor(capacity_tokens / (prompt_mean + (max_gen + admit_every) / 2 + seq_overhead))


class StabilizedAdmission:
    """Load-stabilizing schedule (docs/design.md, "Admission").

    B = target_batch sequences, S = max generation length, F = admit_every steps.
    - Slots: at most B sequences run. Every F steps a micro-batch of M = B*F/S new slots opens
      (the ramp; with varied lengths S here is the mean lifetime, at which rate the steady
      state replaces sequences), so ages spread evenly over [0, S) and the workload settles near B*(S+F)/2
      instead of swinging between ~0 and B*S as a fixed batch does (the start-up spike).
    - A slot freed (at max_tokens or early at EOS) stays open and is refilled at the next step,
      under the W_lim check below, so the workload keeps tracking its target instead of
      decaying. With equal lengths the freed slots are exactly the micro-batch admitted F steps
      earlier, so this is the paper's schedule. When the queue is empty unused slots close, so a
      later burst ramps up again instead of spiking.
    - GETEARLIESTSTEP/ADDMICROBATCH: the projection of the running sequences (rebuilt from
      `running` every call, so it never drifts from the engine's truth at EOS) plus the
      candidates, each assumed to run to max_tokens (an upper bound; but see learnt lengths), must stay <= W_lim at every
      future step; its peak comes just before a running sequence finishes. A micro-batch that
      does not fit is retried at every step, i.e. it starts at its earliest step.
    - W_lim = B*(prompt_mean + (S+F)/2) + M*(prompt_mean + S) + margin_sigmas*sqrt(B+M)*prompt_std
      (default 3): the steady state of the schedule plus the prompts' KV, never above capacity_tokens
      (total KV tokens the R-workers can hold). One micro-batch at full length of slack: S/F is
      rarely whole, so a lifetime holds B/M groups with one gap shorter or longer than F, ages
      slip against the even spread the first term assumes, and its projected peak passes that
      term by up to a group. Without the slack the refused group started with the next one, and
      equal lengths kept such lumps (bench/schedule/admission_sim.py style, B = 128, S = 1000:
      88 of 128 running on average, workload CV 0.43; with it 128, CV 0.03). Slots still cap the
      count at B. The margin: the projected peak moves with the prompts of the B
      running sequences and the M candidates (std ~ sqrt(B+M)*prompt_std). At the bare mean
      about half the micro-batches were refused; the freed slots then refill together, equal
      lengths keep such a group together, and the schedule degenerated into fixed batches of
      ~W_lim/(prompt + S) sequences (bench/schedule/admission_sim.py: B = 64, S = 512, prompts
      16-64 tokens: 38 running, workload CV 0.47; with the margin 64 running, CV 0.03).
    - No deadlock: when nothing runs, the head is admitted even if it alone exceeds W_lim.
    - Fairness: FIFO prefix only. While the head waits nothing else joins, so the running
      sequences are gone within S_max steps and then the head starts: the head waits at most
      S_max steps (max over max_tokens) and everyone is served.
    - Learnt lengths (learn_lengths, default on): once 16 sequences have stopped at EOS
      (fastdecode/sched/length_model.py: Kaplan-Meier over the last 4096 finished and the running
      ones), the projection is the expected one: a sequence of age g holds its tokens at step
      now+t with probability P(L > g+t | L > g), up to its bound. The bound projection is
      pessimistic when EOS comes early: it refused slots the real load had room for
      (bench/schedule/admission_sim.py: 57-58 of 64 running, against 63 with learnt lengths).
      W_lim then bounds the expected projection, so the workload tracks it rather than staying
      under it; capacity_tokens still bounds the worst case, since KV cannot be preempted.
      With no EOS stops (every sequence runs to its bound) nothing changes.
    Defaults: S = length-biased mean generation length (sum m^2 / sum m over the max_tokens
    seen, which makes B*(S+F)/2 the mean projected load of B requests with those bounds; with
    learnt lengths E[min(L, m)^2] / E[min(L, m)]); F = ceil(lifetime/16), a ripple of about
    6% around the target.
    """

    def __init__(self, target_batch: int, admit_every: int | None = None, max_gen: int | None = None,
                 w_lim: float | None = None, ramp: bool = True, margin_sigmas: float = 3.0,
                 learn_lengths: bool = True, seq_overhead_tokens: float = 0.0, slip_slack: bool = True):
        if target_batch < 1:
            raise ValueError("target_batch must be >= 1")
        if admit_every is not None and admit_every < 1:
            raise ValueError("admit_every must be >= 1")
        if max_gen is not None and max_gen < 1:
            raise ValueError("max_gen must be >= 1")
        self.target_batch = target_batch
        self.batch_limit = target_batch      # the asked-for B: a balance (sched/balance.py) moves target_batch below it
        self.admit_every = admit_every
        self.max_gen = max_gen
        self.w_lim = w_lim
        self.ramp = ramp
        self.margin_sigmas = margin_sigmas   # W_lim's margin in prompt-spread stds (0: the bare mean peak)
        self._open = 0                      # slots opened so far (<= B)
        self._last_open: int | None = None   # step the last micro-batch of slots opened
        self._seen = np.zeros(5)            # admitted requests: count, sum m, sum m^2, sum prompt, sum prompt^2
        self._used: dict = {}
        self.lengths = LengthModel() if learn_lengths else None
        # memory a running sequence holds beyond its KV tokens (--kv-reserve grow: page rounding
        # and admission headroom), counted against capacity_tokens but not in the R-load W_lim
        self.seq_overhead = seq_overhead_tokens
        self.slip_slack = slip_slack        # W_lim's micro-batch of slack (False: the rule before it, for ablations)

    def observe_finished(self, generated: int, stopped: bool) -> None:
        if self.lengths is not None:
            self.lengths.observe(generated, stopped)

    @property
    def _learnt(self) -> bool:
        return self.lengths is not None and self.lengths.ready

    def _estimates(self, waiting: np.ndarray) -> tuple[int, int, float, float]:
        """(S, lifetime, prompt_mean, prompt_std) from admitted requests plus the head of the
        queue. S is the length-biased mean generation length (W_lim's growth term), lifetime
        the plain mean (B/lifetime sequences start per step in the steady state: the ramp's
        rate). Equal lengths make them equal."""
        head = waiting[:HEAD_WINDOW].astype(np.float64)
        n, sm, sm2, sp, sp2 = self._seen + [len(head), head[:, 1].sum(), (head[:, 1] ** 2).sum(),
                                            head[:, 0].sum(), (head[:, 0] ** 2).sum()]
        n = max(n, 1.0)
        if self.max_gen is not None:
            s = life = self.max_gen
        elif self._learnt:
            s = self.lengths.length_biased_mean(waiting[:HEAD_WINDOW, 1])
            life = self.lengths.mean_len(waiting[:HEAD_WINDOW, 1])
        else:
            s, life = sm2 / max(sm, 1.0), sm / n
        mean = sp / n
        return (max(1, math.ceil(s - 1e-9)), max(1, math.ceil(life - 1e-9)), mean,
                math.sqrt(max(sp2 / n - mean * mean, 0.0)))

    def admit(self, step: int, waiting: Sequence[tuple[int, int]],
              running: Sequence[tuple[int, int]], capacity_tokens: float | None = None) -> int:
        if len(waiting) == 0:
            self._open = min(self._open, len(running))
            return 0
        B = self.target_batch
        queue = as_pairs(waiting, max(HEAD_WINDOW, B))
        run = _as_rows(running)
        if self.lengths is not None and run.shape[1] >= 3:
            self.lengths.set_running(run[:, 2])
        S, life, prompt_mean, prompt_std = self._estimates(queue)
        o = self.seq_overhead
        B, M, F = spread_batch(B, S, life, prompt_mean, capacity_tokens, o, self.admit_every)
        target = self.target_batch       # W_lim from the asked-for batch: capacity, when that binds
        w_lim = (self.w_lim if self.w_lim is not None
                 else target * (prompt_mean + (S + F) / 2) + self.slip_slack * M * (prompt_mean + S)
                 + self.margin_sigmas * math.sqrt(target + M) * prompt_std)
        if capacity_tokens is not None:
            w_lim = min(w_lim, capacity_tokens - o * B)      # <= B running, each o beyond its tokens
        self._used = {"schedule": "stabilized", "target_batch": self.target_batch, "batch_spread": B,
                      "max_gen": S, "mean_gen": life,
                      "max_gen_source": ("given" if self.max_gen else
                                         "learnt lengths" if self._learnt else "max_tokens"),
                      "admit_every": F, "micro_batch": M, "w_lim": float(w_lim),
                      "prompt_mean": float(prompt_mean), "prompt_std": float(prompt_std), "ramp": self.ramp,
                      "capacity_tokens": capacity_tokens, "seq_overhead_tokens": o}
        due = self._last_open is None or step - self._last_open >= F
        if not self.ramp:
            slots = B
        else:
            slots = min(B, self._open + M) if due else self._open
        k = max(0, min(len(queue), slots - len(running)))      # len(queue) >= B >= slots when long
        if self._learnt and run.shape[1] >= 3:
            # expected projection against W_lim; the worst case only against capacity
            if capacity_tokens is not None:
                k = largest_prefix(projected_workload(run[:, 0], run[:, 1]), queue, capacity_tokens, k)
            k = largest_prefix_expected(self.lengths, run, queue, w_lim, k)
        else:
            k = largest_prefix(projected_workload(run[:, 0], run[:, 1]), queue, w_lim, k)
        if k == 0 and len(running) == 0:
            k = 1                           # lone oversized request: never deadlock
        if k:
            if due and slots > self._open:
                self._last_open = step
            self._open = max(slots, len(running) + k)
            got = queue[:k].astype(np.float64)
            self._seen += [k, got[:, 1].sum(), (got[:, 1] ** 2).sum(), got[:, 0].sum(), (got[:, 0] ** 2).sum()]
        return k

    def describe(self) -> dict:
        out = dict(self._used) or {"schedule": "stabilized", "target_batch": self.target_batch,
                                   "admit_every": self.admit_every, "max_gen": self.max_gen,
                                   "w_lim": self.w_lim, "ramp": self.ramp}
        if self.lengths is not None:
            out["length_model"] = self.lengths.describe()
        return out
