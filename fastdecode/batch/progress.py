"""Progress on rank 0, in generated tokens: a tqdm bar on a terminal, else one log line to stderr
every `interval` seconds (SLURM logs and mpirun output are not terminals).

The log line's format is fixed (docs/usage.md, "Progress"), so scripts can read it:

    fastdecode: progress 42.1% tokens=5120/12160 tok/s=85.3 eta=0:01:22 elapsed=0:01:00 requests=12/40 running=16 waiting=12 kv=2310(1.21%),2280(1.19%)

Percent is tokens generated over the tokens expected (each request's max_tokens, or the length
the schedule has learnt, sched/length_model.py; lines not read yet at the mean so far), the job's
in both: a resumed run counts the earlier runs' rows and the saved tokens it continues as done
(Snapshot.tokens_before), not as this run's. It never goes back, and reads 100.0 only on the last
line, which ends in `done` (or `interrupted`). tok/s (this run's tokens) is over the last minute; kv is each R-worker's KV tokens and the share of its capacity, in
rank order. eta prices what is left as steps, each generating a token for every running
sequence: the steps come from placing the waiting sequences, in order, into the batch's slots as
running ones end (steps_to_finish), and a step costs a + c * (its tokens), a and c fitted over
the last minute (time_left). Tokens left at the recent token rate run low in a job's tail, where
the batch shrinks: fewer tokens per step, each step cheaper.
"""
from __future__ import annotations

import heapq
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from fastdecode.engine.sequence import Status

DEFAULT_INTERVAL_S = 10.0
INTERVAL_ENV = "FASTDECODE_PROGRESS_INTERVAL"
RATE_WINDOW_S = 60.0        # tok/s and the ETA follow the last minute
BAR_REFRESH_S = 0.25        # a bar redraws (and the expectation is recomputed) at most this often
LINE_PREFIX = "fastdecode: progress"


def interval_from(flag: float | None) -> float:
    """Seconds between log lines: --progress-interval, else $FASTDECODE_PROGRESS_INTERVAL, else 10."""
    if flag is not None:
        value, origin = flag, "--progress-interval"
    else:
        text = os.environ.get(INTERVAL_ENV)
        if text is None or not text.strip():
            return DEFAULT_INTERVAL_S
        origin = f"{INTERVAL_ENV}={text!r}"
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{origin}: expected seconds between progress lines, a positive number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{origin}: expected seconds between progress lines, a positive number")
    return float(value)


@dataclass
class Snapshot:
    """Where a run stands (sequences for running/waiting; tokens: the job's, this run's where no
    earlier run is counted)."""
    tokens_done: int
    tokens_expected: float | None          # None: not known yet
    requests_done: int
    requests_total: int | None
    running: int = 0
    waiting: int = 0
    kv_tokens: list[int] = field(default_factory=list)       # [R-workers] KV tokens held
    kv_capacity: list[int] = field(default_factory=list)     # [R-workers] KV tokens each can hold
    steps_done: int | None = None          # the engine's steps so far (None: not tracked; eta by tokens)
    work: Work | None = None               # the steps the work known now still needs (steps_to_finish)
    balance: dict | None = None            # the balance point (StepBalance.describe()) where the rule weighs tiers
    tokens_before: int = 0                 # of tokens_done, those generated before this run (earlier runs'
                                           # rows, saved tokens it continues): no part of the rate


@dataclass(frozen=True)
class Work:
    """The work left as steps: `steps` in all; the first `full_steps` of them with every slot of
    the batch busy, the rest a tail in which the batch shrinks, generating `tail_tokens`."""
    steps: float
    full_steps: float
    tail_tokens: float


def engine_snapshot(engine, requests_done: int, requests_total: int | None, more_expected: float | None = 0.0,
                    since_tokens: int = 0, engine_expected: float | None = None) -> Snapshot:
    """The engine's side of a snapshot; `more_expected`: tokens of requests not added yet (None:
    unknown); `since_tokens`: the engine's output tokens before these requests (an API call's
    progress counts its own); `engine_expected`: engine.expected_output_tokens(), if the caller
    has it already."""
    sched = engine.scheduler
    kv = [0] * len(engine.placement.capacity_tokens)
    running = 0
    for s in sched.running:
        if s.status is Status.RUNNING:
            kv[s.worker] += s.kv_len
            running += 1
    if engine_expected is None and more_expected is not None:
        engine_expected = engine.expected_output_tokens()
    expected = None if more_expected is None else engine_expected + more_expected - since_tokens
    work = None
    if more_expected is not None:
        running_left, waiting_left = engine.tokens_left()
        at_once = running if len(waiting_left) or more_expected else engine.args.max_batch
        work = steps_to_finish(running_left, waiting_left, more_expected, at_once)
    gate = getattr(sched, "balance", None)
    return Snapshot(engine.num_output_tokens - since_tokens, expected, requests_done, requests_total, running,
                    len(sched.waiting), kv, list(engine.placement.capacity_tokens), engine.step_no, work,
                    gate.describe() if gate is not None else None)


def steps_to_finish(running_left, waiting_left, more_tokens: float, at_once: int) -> Work:
    """The steps the known work still needs, a step giving each running sequence one token:
    `at_once` slots, the running sequences in theirs, each waiting one (in order) taking the first
    slot that frees up; the tokens of lines not read yet (`more_tokens`) then fill the slots
    evenly. Every slot is busy until the first one runs out of work."""
    slots = [float(x) for x in running_left] + [0.0] * max(at_once - len(running_left), 0)
    if not slots:
        slots = [0.0]
    heapq.heapify(slots)
    for tokens in waiting_left:
        heapq.heappush(slots, heapq.heappop(slots) + float(tokens))
    ends = sorted(slots)
    level = _level(ends, more_tokens)
    ends = [max(end, level) for end in ends]           # [slots] the step each slot runs out of work
    full = ends[0]
    return Work(ends[-1], full, sum(end - full for end in ends))


def _level(ends: list[float], tokens: float) -> float:
    """The height `tokens` fill the slots to, poured over slots that end at `ends` (sorted)."""
    total = 0.0
    for k, end in enumerate(ends, start=1):
        total += end
        level = (total + tokens) / k
        if k == len(ends) or level <= ends[k]:
            return level
    return ends[-1]


def time_left(samples, tokens_left: float | None, work: Work | None,
              learnt: float | None = None) -> tuple[float | None, float | None]:
    """Seconds the work left takes, from (time, tokens done, steps done) samples of the recent
    past, and the fixed cost of a step in tokens' worth (a / c) where the samples tell it.

    A step costs a + c * (its tokens), (a, c) >= 0 fitted by least squares over the samples'
    intervals. While the batch holds steady, tokens per step do not tell a from c: then the
    a / c `learnt` when they did (an earlier window) splits the recent cost; before any such
    window, the steps with the batch full cost what a step has cost and the tail the geometric
    mean of its steps at that price (high: its steps are smaller) and its tokens at the mean token
    time (low: a step costs something whatever its size). Without step counts: the tokens left at
    the samples' token rate."""
    if tokens_left is None:
        return None, learnt
    if tokens_left <= 0:
        return 0.0, learnt
    d = np.diff(np.array(samples, dtype=np.float64), axis=0)        # [k, 3]: dt, d tokens, d steps
    d = d[d[:, 0] > 0]
    if not len(d) or d[:, 1].sum() <= 0:
        return None, learnt
    counted = d[np.isfinite(d[:, 2])]                                # intervals whose steps are known
    if work is None or not len(counted) or counted[:, 2].sum() <= 0 or counted[:, 1].sum() <= 0:
        return tokens_left * d[:, 0].sum() / d[:, 1].sum(), learnt
    dt, dn, ds = counted[:, 0], counted[:, 1], counted[:, 2]
    fit = _step_cost(dt, dn, ds)
    if fit is not None:
        a, c = fit
        return a * work.steps + c * tokens_left, (a / c if c > 0 else np.inf)
    if learnt is not None:
        if np.isinf(learnt):
            return work.steps * dt.sum() / ds.sum(), learnt
        c = dt.sum() / (learnt * ds.sum() + dn.sum())
        return c * (learnt * work.steps + tokens_left), learnt
    per_step, per_token = dt.sum() / ds.sum(), dt.sum() / dn.sum()
    tail = np.sqrt((work.steps - work.full_steps) * per_step * work.tail_tokens * per_token)
    return work.full_steps * per_step + tail, learnt


STEADY_SPREAD = 0.05        # tokens per step varying less than this (relative): a steady batch


def _step_cost(dt: np.ndarray, dn: np.ndarray, ds: np.ndarray) -> tuple[float, float] | None:
    """(a, c) >= 0 with dt ~ a * ds + c * dn, or None where the samples cannot tell them apart."""
    steps = ds > 0
    per_step = dn[steps] / ds[steps]                                 # tokens per step of each interval
    if len(per_step) < 2 or np.ptp(per_step) <= STEADY_SPREAD * per_step.mean():
        return None
    (a, c), *_ = np.linalg.lstsq(np.stack([ds, dn], axis=1), dt, rcond=None)
    return (float(a), float(c)) if a >= 0 and c >= 0 and a + c > 0 else None


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_line(percent: float, snap: Snapshot, rate: float, elapsed: float, eta: float | None,
                  state: str | None = None) -> str:
    expected = "?" if snap.tokens_expected is None else str(round(snap.tokens_expected))
    total = "?" if snap.requests_total is None else str(snap.requests_total)
    kv = ",".join(f"{t}({100 * t / c:.2f}%)" if c else f"{t}(?)" for t, c in zip(snap.kv_tokens, snap.kv_capacity))
    line = (f"{LINE_PREFIX} {percent:.1f}% tokens={snap.tokens_done}/{expected} tok/s={rate:.1f} "
            f"eta={clock(eta)} elapsed={clock(elapsed)} requests={snap.requests_done}/{total} "
            f"running={snap.running} waiting={snap.waiting} kv={kv or '-'}{balance_fields(snap.balance)}")
    return f"{line} {state}" if state else line


def balance_fields(balance: dict | None) -> str:
    """The balance point's fields of a progress line (empty until a decode step measured it): the
    sequences on the S-worker's tier and on the R-workers, the side that bounds the step, and each
    side's seconds per step."""
    if not balance or "bound" not in balance:
        return ""
    return (f" tier_seqs={balance['sequences_tier']} r_seqs={balance['sequences_rworkers']} "
            f"bound={balance['bound']} s_step={balance['s_step_s']:.4f} r_step={balance['r_step_s']:.4f}")


class Progress:
    """Call update() as often as you like (every step); it renders only when due. finish(state)
    writes the last line (log mode) or closes the bar."""

    def __init__(self, snapshot, enabled: bool = True, interval: float | None = None, stream=None,
                 bar: bool | None = None, clock=time.perf_counter):
        self.snapshot = snapshot
        self.enabled = enabled
        self.interval = interval_from(interval) if enabled else DEFAULT_INTERVAL_S
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = self.last = clock()
        self.shown = 0.0                                   # percent shown so far: it never goes back
        self.samples = deque([(self.start, 0, np.nan)])   # (time, tokens done, steps done): the rate's window
                                                           # (the engine's steps at the start are not known)
        self.fixed_cost: float | None = None               # a step's fixed cost in tokens' worth, once learnt
        self.bar = None
        self.bar_before = 0                                # tokens_before the bar holds already
        if enabled and (bar if bar is not None else _isatty(self.stream)):
            try:
                from tqdm import tqdm
            except ImportError:                            # R-worker-only installs: log lines instead
                tqdm = None
            if tqdm is not None:
                # tqdm's own remaining time is tokens left at its rate, low in a shrinking tail: the
                # postfix shows this module's eta instead
                self.bar = tqdm(total=0, unit="tok", dynamic_ncols=True, file=self.stream, desc="tokens",
                                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> bool:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        return False

    def _measure(self, now: float, done: bool) -> tuple[Snapshot, float, float, float | None]:
        snap = self.snapshot()
        ran = snap.tokens_done - snap.tokens_before                # this run's
        self.samples.append((now, ran, np.nan if snap.steps_done is None else snap.steps_done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.popleft()
        t0, n0, _ = self.samples[0]
        rate = (ran - n0) / (now - t0) if now > t0 else 0.0
        if done:
            snap.tokens_expected = snap.tokens_done
            self.shown = 100.0
        elif snap.tokens_expected:
            self.shown = max(self.shown, min(99.9, 100.0 * snap.tokens_done / snap.tokens_expected))
        left = None if snap.tokens_expected is None else max(snap.tokens_expected - snap.tokens_done, 0.0)
        work = snap.work if snap.steps_done is not None else None
        eta, self.fixed_cost = time_left(self.samples, left, work, self.fixed_cost)
        return snap, rate, self.shown, eta

    def update(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self.last < (BAR_REFRESH_S if self.bar is not None else self.interval):
            return
        self.last = now
        snap, rate, percent, eta = self._measure(now, done=False)
        if self.bar is not None:
            self._draw(snap, eta)
        else:
            self._log(progress_line(percent, snap, rate, now - self.start, eta))

    def finish(self, state: str = "done") -> None:
        """The last report: `done` (100%) or `interrupted` (where the run stopped)."""
        if not self.enabled:
            return
        now = self.clock()
        snap, rate, percent, eta = self._measure(now, done=state == "done")
        if self.bar is not None:
            self._draw(snap, eta)
            self.bar.close()
            self.bar = None
        else:
            self._log(progress_line(percent, snap, rate, now - self.start, eta, state))

    def _draw(self, snap: Snapshot, eta: float | None) -> None:
        bar = self.bar
        bar.total = max(round(snap.tokens_expected or 0), snap.tokens_done)
        carried = snap.tokens_before - self.bar_before      # earlier runs' tokens: shown, not in tqdm's rate
        if carried > 0:
            bar.n += carried
            bar.last_print_n += carried
            bar.initial += carried
            self.bar_before = snap.tokens_before
        bar.update(snap.tokens_done - bar.n)                # through update: tqdm's own rate
        total = "?" if snap.requests_total is None else snap.requests_total
        bar.set_postfix_str(f"eta {clock(eta)}, requests {snap.requests_done}/{total}, running {snap.running}, "
                            f"waiting {snap.waiting}", refresh=False)
        bar.refresh()

    def _log(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
