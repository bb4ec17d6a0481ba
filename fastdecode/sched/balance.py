"""The balance rule: a sequence starts only while it raises the job's tokens/s.

A decode step decodes B sequences in T(B) seconds, so the job runs at B / T(B) tokens/s. One more
sequence pays when (B + 1) / T(B + 1) >= B / T(B), i.e. when the time it adds to the step is no
more than the step's time per sequence. The step's time comes from the sides that run it:

    S      = s(B) + tier_load / tier_speed        the S-part (head and sampling included), then the
                                                  S-worker's own tier's attention on the same path
    R      = max((R_load + sum_w v_w b_w)         the k R-workers as one pool of speeds v_w
                 / sum_w v_w, one sequence's,     (placement spreads the load; b_w: each one's
                 ceil(n / k) sequences' where     kernel calls' fixed cost and other work), at
                 n / k < 2)                       least the longest one sequence takes, and with
                                                  few of the n R-rows a worker, the fullest
                                                  worker's whole sequences
    P      = R / d + one sequence's x (1 - 1/d)   the heaviest mini-batch's share: a d-th, plus
                                                  the part of a sequence that does not divide
                                                  (a few long sequences cannot be split d ways)
    L(n)   = link_fixed + link_row x n            n R-rows there and back on the link
    T(B)   = max(S, R, s(B) / d + L(R_rows / d)   depth d >= 2: a mini-batch's dense part, its rows'
                 + P)                             trip and attention in turn (its tier rows wait
                                                  until its R-rows have left)
    T(B)   = s(B) + max(tier part, L + R)         depth 1: the R-workers run beside the tier only

so an R-worker takes sequences for free while its attention fits in the S-side's time, and past
that only while the longer step buys more sequences than it costs: a step the R-workers already
bind gains nothing from a sequence added there while another place (the tier) holds sequences.
Memory stays a cap (placement refuses a worker without room), not the target.

Everything is learnt from the job's own decode steps (`observe`), so the balance follows the job:
s(B) by batch (an exponential average per band of B, interpolated between bands, extended past the
largest seen along the last slope: where that guesses high, the steps there correct it),
each worker's seconds per KV token from its kernel time (placement's start-up speeds are the
prior), each R-worker's overhead (its busy time beyond the kernel), and the link's seconds per
R-row: T - s / d - P of a step the S-worker waited in is a mini-batch's trip, of any other step
at least a bound on it. `load` is
placement's projected load (prompt + half the generation bound, all layers), the tokens a
sequence holds over its life on average.

The rule weighs the S-worker's own tier against the R-workers: with R-workers alone every sequence
they hold adds to a step they bind in proportion, so memory bounds the batch there as before (the
class still learns, for the report). The engine (engine/llm_engine.py) and the simulator
(sim/core.py) both run this class: placement
asks `times_with` where a sequence makes the step grow least, the scheduler asks `admits` before
it starts one, `follow_balance` sets the stabilized schedule's target, and each decode step's
measurements go to `observe`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fastdecode.sched.placement import Placement

WEIGHT = 0.3              # the exponential averages' weight of the newest step
BANDS_PER_OCTAVE = 4      # s(B) is learnt per quarter-octave band of B
TIE = 1e-9                # relative slack of the marginal test (a step time that does not change pays)
WAITED = 0.02             # a step whose S-worker waited this fraction of it for the R-workers teaches the link
LUMPY_ROWS = 2            # under this many R-rows a worker, R counts whole sequences on the fullest worker
TRIP_WEIGHT = 0.05        # the trip's averages: slower, so they keep the spread of rows that tells fixed from per-row


class BatchCurve:
    """s(B): seconds of an S-part decode step at B rows, learnt per band of B."""

    def __init__(self):
        self.points: dict[int, list[float]] = {}       # band -> [mean B, mean seconds]

    @staticmethod
    def _band(rows: int) -> int:
        return int(math.floor(math.log2(max(rows, 1)) * BANDS_PER_OCTAVE))

    def observe(self, rows: int, seconds: float, weight: float = WEIGHT) -> None:
        if rows < 1 or not seconds > 0:
            return
        p = self.points.get(self._band(rows))
        if p is None:
            self.points[self._band(rows)] = [float(rows), float(seconds)]
        else:
            p[0] += weight * (rows - p[0])
            p[1] += weight * (seconds - p[1])

    @property
    def known(self) -> bool:
        return bool(self.points)

    def __call__(self, rows: float) -> float:
        """Seconds at `rows`: linear between the learnt points, flat below them, and above them along
        the last two points' slope (0 if it falls), as a dense part's time grows with its rows
        (0: nothing learnt)."""
        if not self.points:
            return 0.0
        pts = sorted(self.points.values())
        if rows <= pts[0][0]:
            return pts[0][1]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if rows <= b1:
                return s0 + (s1 - s0) * (rows - b0) / max(b1 - b0, 1e-9)
        if len(pts) < 2:
            return pts[-1][1]
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
        return s1 + max(s1 - s0, 0.0) / max(b1 - b0, 1e-9) * (rows - b1)


class StepBalance:
    def __init__(self, placement: Placement, depth: int, tier: int | None = None,
                 fixed_s: list[float] | None = None, speeds_known: bool = True,
                 trip: tuple[float, float] | None = None):
        """fixed_s [W]: each worker's kernel seconds per step whatever it holds (its calls' fixed
        cost, measured at start-up); speeds_known: placement's speeds were measured (else its
        first decode step sets them); trip: the link's (seconds fixed, seconds per R-row) of a
        mini-batch's trip, all layers, as measured at start-up (the prior its steps then correct;
        None: 0, learnt from the first steps with R-rows)."""
        n = len(placement.capacity_tokens)
        self.placement = placement
        self.depth = max(int(depth), 1)
        self.tier = tier                                  # the S-worker's own tier's worker index
        self.s_curve = BatchCurve()
        self.fixed = list(fixed_s) if fixed_s is not None else [0.0] * n
        self.known = [speeds_known] * n
        self.overhead = [0.0] * n                         # seconds per step an R-worker spends besides its kernel
        self.link = [float(x) for x in trip] if trip else [0.0, 0.0]   # the trip: seconds fixed, per R-row
        self._trips = None                                # EMAs of rows, seconds, rows^2, rows x seconds
        self.refused = 0                                  # sequences held back by the rule (the report's)
        self.last: dict = {}                              # the latest step as measured (describe())

    def attach(self) -> StepBalance:
        """Placement's worker choice by this step model: a sequence goes where the step grows least."""
        self.placement.step_model = self
        return self

    # ------------------------------------------------------------------ the model

    def _base(self, w: int) -> float:
        return self.fixed[w] + self.overhead[w]

    def _pool(self) -> tuple[float, float, int]:
        """The R-workers as one pool: (their summed speed, summed speed x base seconds, how many)."""
        speed = weighted = 0.0
        count = 0
        for w, v in enumerate(self.placement.bandwidth):
            if w != self.tier:
                speed, weighted, count = speed + v, weighted + v * self._base(w), count + 1
        return speed, weighted, count

    def _single(self, load: list[float], resident: list[int]) -> float:
        """The longest one sequence takes on its R-worker (its worker's mean per sequence)."""
        return max((self._base(w) + x / n / self.placement.bandwidth[w]
                    for w, (x, n) in enumerate(zip(load, resident)) if w != self.tier and n > 0), default=0.0)

    def _r_time(self, r_load: float, r_rows: int, single: float, pool: tuple[float, float, int]) -> tuple[float, float]:
        """(R, P): the R-workers' seconds per step and the heaviest mini-batch's share of them.
        R: the load spread over the pool by speed, at least one sequence's time, and where the
        rows are few (under LUMPY_ROWS a worker) whole sequences: n rows on k workers leave
        ceil(n / k) on the fullest. P: a d-th of R, plus the part of a sequence that does not
        divide (a few long sequences are lumps the mini-batches cannot split evenly)."""
        speed, weighted, count = pool
        if r_load <= 0 or speed <= 0 or r_rows <= 0:
            return 0.0, 0.0
        per_worker = r_rows / count
        lumps = single * math.ceil(per_worker - 1e-9) if per_worker < LUMPY_ROWS else 0.0
        r_s = max((r_load + weighted) / speed, single, lumps)
        return r_s, self._piece(r_s, single)

    def _piece(self, r_s: float, single: float) -> float:
        return r_s / self.depth + single * (1 - 1 / self.depth)

    def _r_rows(self, resident: list[int]) -> int:
        return sum(resident) - (resident[self.tier] if self.tier is not None else 0)

    def _time(self, s_rows: float, r_rows: float, tier_load: float, r_s: float, piece_s: float) -> float:
        """T with the S-part at `s_rows` rows, `r_rows` rows on the R-workers, the tier's load, the
        R-workers' seconds and the heaviest mini-batch's share (module docstring)."""
        s = self.s_curve(s_rows)
        tier_s = self.fixed[self.tier] + tier_load / self.placement.bandwidth[self.tier] \
            if self.tier is not None and tier_load > 0 else 0.0
        if r_rows <= 0:
            return s + tier_s
        if self.depth == 1:
            return s + max(tier_s, self.trip(r_rows) + r_s)
        return max(s + tier_s, r_s, s / self.depth + self.trip(max(r_rows / self.depth, 1)) + piece_s)

    def trip(self, rows: float) -> float:
        """Seconds of one mini-batch's `rows` R-rows there and back on the link, all layers."""
        return self.link[0] + self.link[1] * rows

    def step_time(self, load: list[float], resident: list[int], s_rows: int | None = None) -> float:
        """T(B): one decode step's seconds for these projected loads (tokens, all layers) and
        sequences per worker (module docstring); the S-part read at `s_rows` (default B)."""
        tier_load = load[self.tier] if self.tier is not None else 0.0
        rows = sum(resident) if s_rows is None else s_rows
        r_rows = self._r_rows(resident)
        r = self._r_time(sum(load) - tier_load, r_rows, self._single(load, resident), self._pool())
        return self._time(rows, r_rows, tier_load, *r)

    def times_with(self, extra: list[float]) -> list[float]:
        """[W] T(B + 1) with one more sequence of extra[w] projected tokens on worker w."""
        p = self.placement
        rows, r_rows = sum(p.resident) + 1, self._r_rows(p.resident)
        tier_load = p.load[self.tier] if self.tier is not None else 0.0
        r_load, single, pool = sum(p.load) - tier_load, self._single(p.load, p.resident), self._pool()
        out = []
        for w, x in enumerate(extra):
            if w == self.tier:
                out.append(self._time(rows, r_rows, tier_load + x, *self._r_time(r_load, r_rows, single, pool)))
                continue
            n = p.resident[w] + 1                        # seq's worker: its mean per sequence with seq on it
            mine = self._base(w) + (p.load[w] + x) / n / p.bandwidth[w]
            r = self._r_time(r_load + x, r_rows + 1, max(single, mine), pool)
            out.append(self._time(rows, r_rows + 1, tier_load, *r))
        return out

    def admits(self, seq, worker: int | None = None, shared_tokens: int = 0) -> bool:
        """Whether starting seq (on `worker`, default where placement puts it: where the step grows
        least) raises tokens/s. True where no worker has room (placement refuses it on its own),
        nothing runs, or there is no tier to weigh the R-workers against (module docstring)."""
        p = self.placement
        if self.tier is None:
            return True
        w = p.best(seq, None if worker is None else (worker,), shared_tokens)
        rows = sum(p.resident)
        if w is None or rows == 0:
            return True
        # both sides with the S-part at B + 1 rows: a dense layer's time per row does not rise with
        # its rows, so the S-part's own growth is never the reason to refuse (a noisy s(B) would be)
        before = self.step_time(p.load, p.resident, s_rows=rows + 1)
        extra = [0.0] * len(p.load)
        extra[w] = p.projected_load(seq, w) - shared_tokens
        after = self.times_with(extra)[w]
        if (rows + 1) * before >= rows * after * (1 - TIE):
            return True
        level = self._level_fill(w, extra[w])        # lumpy R-workers: the round it starts may pay as a whole
        if level is not None and (rows + level[0]) * before >= rows * level[1] * (1 - TIE):
            return True
        self.refused += 1
        return False

    def _level_fill(self, w: int, x: float) -> tuple[int, float] | None:
        """(k, T(B + k)) for k sequences like one of x projected tokens on R-worker w, k the rows
        that bring every R-worker to the next whole sequence (where the rows are lumps: under
        LUMPY_ROWS a worker). The first sequence of a round lengthens the step by a whole
        sequence's time, the rest of the round adds nothing to it: one at a time never pays, the
        round can. None: not lumpy, or w is the tier."""
        p = self.placement
        r_rows, pool = self._r_rows(p.resident), self._pool()
        count = pool[2]
        if w == self.tier or not count or (r_rows + 1) / count >= LUMPY_ROWS:
            return None
        k = count * math.ceil((r_rows + 1) / count) - r_rows
        tier_load = p.load[self.tier] if self.tier is not None else 0.0
        mine = self._base(w) + (p.load[w] + x) / (p.resident[w] + 1) / p.bandwidth[w]
        r = self._r_time(sum(p.load) - tier_load + k * x, r_rows + k, max(self._single(p.load, p.resident), mine),
                         pool)
        return k, self._time(sum(p.resident) + k, r_rows + k, tier_load, *r)

    def balance_batch(self, prompt_len: float, max_tokens: float, cap: int) -> int:
        """Sequences of this size that run at the balance point (the stabilized schedule's target):
        those running now, what the tier's free memory holds, and what the R-workers take while
        each one still raises tokens/s (spread over them by speed), at most `cap` (a search over
        the model: once per admission round)."""
        p = self.placement
        x = max(prompt_len + max_tokens / 2, 1.0)                 # projected tokens of one sequence
        bound = max(prompt_len + max_tokens, 1.0)
        free = [max(c - r, 0) // bound for c, r in zip(p.capacity_tokens, p.reserved)]     # by memory
        r_workers = [w for w in range(len(free)) if w != self.tier]
        r_free = sum(free[w] for w in r_workers)
        rows = sum(p.resident)
        tier_load = p.load[self.tier] if self.tier is not None else 0.0
        if self.tier is not None:
            rows += free[self.tier]
            tier_load += free[self.tier] * x
        if not self.s_curve.known:
            return max(1, min(int(rows + (r_free if self.tier is None else 0)), cap))   # nothing learnt yet
        r_rows, pool = self._r_rows(p.resident), self._pool()
        r_load = sum(p.load) - (p.load[self.tier] if self.tier is not None else 0.0)
        single = max(self._single(p.load, p.resident),
                     max((self._base(w) + x / p.bandwidth[w] for w in r_workers), default=0.0))

        def rate(n: int, s_rows: int) -> float:     # tokens/s with n more sequences on the R-workers
            r = self._r_time(r_load + n * x, r_rows + n, single, pool)
            t = self._time(s_rows, r_rows + n, tier_load, *r)
            return (rows + n) / t if t > 0 else math.inf

        top = int(min(r_free, cap))
        lo, hi = 0, top                       # the last n whose sequence still paid (tokens/s rises, then falls)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            paid = rate(mid, rows + mid) >= rate(mid - 1, rows + mid) * (1 - TIE)
            lo, hi = (mid, hi) if paid else (lo, mid - 1)
        # lumpy R-workers (under LUMPY_ROWS a worker): a whole round of one more sequence each can
        # pay where its first sequence alone does not; the best of the rounds' ends
        count = pool[2]
        rounds = [count * j - r_rows for j in range(1, LUMPY_ROWS + 1)] if count else []
        best = max([lo] + [n for n in rounds if lo < n <= top], key=lambda n: (rate(n, rows + n), -n))
        return max(1, min(int(rows + best), cap))

    # ------------------------------------------------------------------ learning

    def observe(self, rows: int, s_side_s: float, kv_tokens: list[float], attend_s: list[float],
                busy_s: list[float] | None = None, r_wait_s: float = 0.0, repeat: int = 1) -> None:
        """One decode step as measured: its rows; the S-side's seconds (the S-part, the head and the
        tier's attention; not its waits for the R-workers); per worker the KV tokens it attended
        (all layers), its kernel seconds and its busy seconds; the S-worker's wait for the R-workers.
        repeat: the averages move as if `repeat` such steps came in a row (the simulator's spans)."""
        p = self.placement
        weight = 1 - (1 - WEIGHT) ** repeat
        tier_s = attend_s[self.tier] if self.tier is not None and self.tier < len(attend_s) else 0.0
        s_part = max(s_side_s - tier_s, 0.0)
        self.s_curve.observe(rows, s_part, weight)
        if self.tier is not None:        # placement's own cost of the tier: the S-part its attention queues behind
            t = self.tier
            p.base_s[t] = s_part if p.overflow_only[t] or p.base_s[t] == 0 else \
                (1 - weight) * p.base_s[t] + weight * s_part
            p.overflow_only[t] = False
        r_rows = self._r_rows(p.resident)
        r_att = single = 0.0
        for w, (tokens, secs) in enumerate(zip(kv_tokens, attend_s)):
            kernel = secs - self.fixed[w]           # what the tokens took; a near-empty worker's is its calls
            if tokens > 0 and secs > 0 and not self.known[w]:
                p.bandwidth[w] = tokens / max(kernel, secs / 2)
                self.known[w] = True
            elif tokens > 0 and kernel > self.fixed[w]:
                p.bandwidth[w] = 1.0 / ((1 - weight) / p.bandwidth[w] + weight * kernel / tokens)
            if w == self.tier or tokens <= 0:
                continue
            busy = busy_s[w] if busy_s is not None and w < len(busy_s) else secs
            self.overhead[w] += weight * (max(busy - secs, 0.0) - self.overhead[w])
            r_att = max(r_att, busy)
            single = max(single, busy / max(p.resident[w], 1))
        step = s_side_s + r_wait_s
        if r_rows:               # T = s / d + trip + P where the S-worker waited, T >= that where not (any depth)
            rows_mb = max(r_rows / self.depth, 1)
            trip = max(step - s_part / self.depth - self._piece(r_att, single), 0.0)
            if r_wait_s > WAITED * step or self.trip(rows_mb) > trip:
                self._learn_trip(rows_mb, trip, repeat)
        on_tier = p.resident[self.tier] if self.tier is not None else 0
        self.last = {"sequences_tier": int(on_tier), "sequences_rworkers": int(sum(p.resident) - on_tier),
                     "s_step_s": round(s_side_s, 6), "r_step_s": round(r_att, 6), "r_wait_s": round(r_wait_s, 6),
                     "bound": "R" if r_wait_s > WAITED * step else "S", "held_back": self.refused}

    def _learn_trip(self, rows: int, seconds: float, repeat: int = 1) -> None:
        """The trip's fixed and per-row seconds: a line through the steps the S-worker waited in
        (slow averages, so the ramp's spread of rows stays in them); one per row while they spread
        too little to tell the two apart."""
        point = (rows, seconds, rows * rows, rows * seconds)
        weight = 1 - (1 - TRIP_WEIGHT) ** repeat
        self._trips = list(point) if self._trips is None else \
            [a + weight * (b - a) for a, b in zip(self._trips, point)]
        r, y, rr, ry = self._trips
        var, cov = rr - r * r, ry - r * y
        if var > (0.1 * r) ** 2:
            slope = max(cov / var, 0.0)
            self.link = [max(y - slope * r, 0.0), slope]
        else:
            self.link = [0.0, y / max(r, 1e-9)]

    def describe(self) -> dict:
        """The balance point as last measured: sequences on the tier and on the R-workers, the S-side's
        and the slowest R-worker's seconds per step, the S-worker's wait, the bound side, and how
        many times the rule held the queue's head back so far."""
        return dict(self.last) or {"held_back": self.refused}


def follow_balance(admission, balance: StepBalance, waiting: list[tuple[int, int]], max_batch: int) -> None:
    """The stabilized schedule's target batch from the balance point (the user's --target-batch or
    --max-batch an upper limit): it keeps the R-load level at the batch that pays, not at the
    batch memory holds. Other controllers are left alone (the balance gates their admissions)."""
    if not hasattr(admission, "batch_limit") or not len(waiting):
        return
    head = np.asarray(waiting[:64], dtype=np.float64).reshape(-1, 2)        # [<=64, 2] prompt, max_tokens
    prompt, gen = (float(x) for x in head.mean(axis=0))
    admission.target_batch = balance.balance_batch(prompt, gen, min(admission.batch_limit, max_batch))
