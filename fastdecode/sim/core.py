"""The job's steps, as the engine runs them (fastdecode/engine/llm_engine.py, LLMEngine.step),
timed by the profile instead of run.

Each step: the admission controller (the engine's own classes, fastdecode/sched/admission.py)
picks how many queued requests start; they are placed on R-workers (the engine's Placement) and
prefilled together up to --max-prefill-tokens (the scheduler's rule: the first always, the next
while the chunk stays within it), each sampling its first token at the prefill's end; then every
running sequence decodes one token (fastdecode/sim/kernel.py times it); a sequence ends when it
has generated its trace's output length, and a controller that learns lengths hears of it.
A request joins the queue at its arrival time; with nothing to run, time skips to the next.

With the S-worker's own KV tier (the profile's device_tier) placement is the engine's across
tiers: the workers' speeds set from the profile (a CPU S-worker's own store takes only what the
R-workers have no room for until the S-part is timed), and the tier's attention on the S side of
the step. The balance rule (sched/balance.py) is the engine's too: each decode step's times go to
the same StepBalance the engine feeds, which gates admissions and sets the stabilized target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fastdecode.sched.admission import HEAD_WINDOW, FifoAdmission, StabilizedAdmission
from fastdecode.sched.balance import StepBalance, follow_balance
from fastdecode.sched.placement import Placement
from fastdecode.sim.costs import Costs
from fastdecode.sim.kernel import step_function
from fastdecode.sim.trace import Trace


@dataclass(slots=True)
class SimConfig:
    rworkers: int = 1               # 0: a GPU-only engine on the S-worker's own tier
    depth: int = 2                  # --pipeline-depth
    schedule: str = "fifo"          # fifo | stabilized
    max_batch: int = 256
    max_prefill_tokens: int = 8192
    target_batch: int | None = None
    admit_every: int | None = None
    max_gen: int | None = None
    learn_lengths: bool = True
    balance: bool = True            # generate's --balance: start a sequence only while it raises tokens/s
    use_numba: bool = True
    max_steps: int = 10_000_000
    # steps between two events (a start or an end) taken as one span in closed form: each is the
    # last one token longer, so their times lie on a line (checked, bisected where they do not)
    span_steps: bool = False


def make_admission(cfg: SimConfig):
    """The controller the engine builds for these flags (LLMEngine._make_admission, --kv-reserve full)."""
    if cfg.schedule == "fifo":
        return FifoAdmission(cfg.max_batch, worst_case=True)
    if cfg.schedule == "stabilized":
        return StabilizedAdmission(min(cfg.target_batch or cfg.max_batch, cfg.max_batch), cfg.admit_every,
                                   cfg.max_gen, learn_lengths=cfg.learn_lengths)
    raise ValueError(f"schedule must be 'fifo' or 'stabilized', got {cfg.schedule!r}")


class _Seq:
    """What placement reads of a sequence (fastdecode/engine/sequence.py's Sequence)."""
    __slots__ = ("generated", "max_tokens", "prompt_len", "seq_id", "worker")

    def __init__(self, seq_id: int, prompt_len: int, max_tokens: int):
        self.seq_id, self.prompt_len, self.max_tokens, self.generated, self.worker = \
            seq_id, prompt_len, max_tokens, 0, -1

    @property
    def kv_len(self) -> int:
        return self.prompt_len + max(self.generated - 1, 0)

    @property
    def total_len_bound(self) -> int:
        return self.prompt_len + self.max_tokens


@dataclass(slots=True)
class SimRun:
    """Per step [T]: end time, rows decoded, tokens sampled, admitted, waiting, prefill and decode
    seconds, S busy in the decode (the tier's attention included), each R-worker's busy [T, P] and
    KV tokens held [T, P], link busy each way, the S-worker's tier's attention and KV tokens held
    (0 without one). Per request [n]: admission step and finish time (-1: never). Token gaps as
    (seconds, how many) pairs: each is the time between two consecutive tokens of one sequence."""
    steps: dict = field(default_factory=dict)
    admitted_step: np.ndarray | None = None
    finish_s: np.ndarray | None = None
    gap_s: np.ndarray | None = None
    gap_count: np.ndarray | None = None
    admission: dict = field(default_factory=dict)


STEP_KEYS = ("t_s", "active", "tokens", "admitted", "waiting", "prefill_s", "decode_s", "s_time_s",
             "link_out_s", "link_back_s", "tier_busy_s", "tier_kv_tokens", "span")
SPAN_TOL = 1e-3            # a span's midpoint within this share of its ends' mean: times taken as linear
SPAN_OBSERVED = 32         # a span's steps the balance hears (its moving averages settle within them)
SPAN_MIN = 8               # shorter spans are stepped: three step evaluations cost more than they save


def simulate(costs: Costs, trace: Trace, cfg: SimConfig) -> SimRun:
    tier = costs.tier
    if cfg.rworkers < (0 if tier >= 0 else 1) or cfg.depth < 1 or cfg.max_batch < 1 or cfg.max_prefill_tokens < 1:
        raise ValueError("rworkers (0 only with the S-worker's own tier), depth, max_batch and max_prefill_tokens "
                         "must be >= 1")
    if cfg.rworkers != costs.rworkers:
        raise ValueError(f"the costs are for {costs.rworkers} R-workers, the job has {cfg.rworkers}")
    if cfg.max_batch >= costs.s_table.size:
        raise ValueError(f"max_batch {cfg.max_batch} exceeds the cost tables ({costs.s_table.size - 1})")
    job = _Job(costs, trace, cfg)
    n = len(trace)
    order = np.lexsort((np.arange(n), trace.arrival_s))          # FIFO: by arrival, then trace order
    arrival = trace.arrival_s[order]
    queued = np.stack([trace.prompt_len[order], trace.max_tokens[order]], axis=1)    # [n, 2] in queue order
    now, nxt, step = 0.0, 0, 0
    while (nxt < n or job.running) and step < cfg.max_steps:
        end = nxt + int(np.searchsorted(arrival[nxt:], now, side="right"))
        if not job.running and end == nxt:
            now = float(arrival[nxt])                             # idle until the next request arrives
            continue
        step += 1
        new, held_back = job.admit(order[nxt:end], queued[nxt:end], step)
        nxt += len(new)
        now = job.step(now, new, end - nxt)
        # nothing can start before a sequence ends (memory or the batch limit holds the queue, or
        # it is empty for good): the steps up to the next end differ only by their length
        if cfg.span_steps and not new and job.running and (held_back or nxt == n):
            now, spanned = job.span(now, end - nxt)
            step += spanned
    return job.result()


class _Job:
    """The simulated engine's state: sequences, placement, the controller and balance, and what
    each step recorded."""

    def __init__(self, costs: Costs, trace: Trace, cfg: SimConfig):
        self.costs, self.trace, self.cfg, self.tier = costs, trace, cfg, costs.tier
        self.step_fn = step_function(cfg.use_numba)
        self.controller = make_admission(cfg)
        self.placement = Placement(costs.workers(), int(costs.kv_bytes_token), policy="full")
        if self.tier >= 0:      # as LLMEngine sets it up: measured speeds, the tier's S-part time still unknown
            self.placement.set_speeds(costs.speeds())
            self.placement.overflow_only[self.tier] = costs.profile.device_tier.kind == "local"
        self.balance, self.gate = _balance(self.placement, costs, cfg)
        self.capacity = self.placement.total_capacity_tokens()
        n = len(trace)
        self.seqs = [_Seq(i + 1, int(trace.prompt_len[i]), int(trace.max_tokens[i])) for i in range(n)]
        self.admitted_step, self.finish_s = np.full(n, -1, np.int64), np.full(n, -1.0)
        self.running: list[int] = []                              # request indices, admission order
        self.rec = {k: [] for k in STEP_KEYS}
        self.r_busy, self.kv_held, self.gaps = [], [], []

    def admit(self, queue: np.ndarray, pairs: np.ndarray, step: int) -> tuple[list[int], bool]:
        """queue [k]: the arrived requests not started, in order; pairs [k, 2]: their prompt and max_tokens."""
        new, held_back = _admit(self.controller, self.placement, self.gate, self.seqs, self.trace, queue, pairs,
                                self.running, self.cfg, step, self.capacity)
        self.admitted_step[new] = step
        return new, held_back

    def _rows(self, ahead: int = 0):
        """The running rows' arrays as the step after `ahead` more tokens sees them."""
        idx = np.array(self.running, np.int64)
        gen = np.array([self.seqs[i].generated for i in self.running], np.int64) + ahead
        worker = np.array([self.seqs[i].worker for i in self.running], np.int64)
        kv = self.trace.prompt_len[idx] + gen                              # [m] tokens attended
        return idx, worker, kv, self.costs.read_tokens(kv)                # read: [m] tokens read per layer

    def _decode(self, ahead: int = 0) -> np.ndarray:
        c, cfg = self.costs, self.cfg
        idx, worker, kv, read = self._rows(ahead)
        return self.step_fn(kv, read, idx + 1, worker, cfg.depth, c.num_workers, c.layers, c.s_table,
                            float(c.head_table[idx.size]), c.r_token_s, c.r_call_s, c.out_bytes_row,
                            c.back_bytes_row, c.link, c.msg_bytes, c.msg_time, self.tier)

    def step(self, now: float, new: list[int], waiting: int) -> float:
        """One engine step: the admitted prefill, then every running sequence decodes a token. -> its end."""
        trace, seqs = self.trace, self.seqs
        sent = np.array([seqs[i].worker != self.tier for i in new], bool)
        prefill = self.costs.prefill_s(trace.prompt_len[new], sent) if new else 0.0
        for i in new:
            seqs[i].generated = 1
        done_now = [i for i in new if trace.output_len[i] <= 1]
        old = len(self.running)
        self.running += [i for i in new if trace.output_len[i] > 1]
        res = self._decode()
        _, worker, kv, read = self._rows()
        decode = float(res[0])
        if worker.size:
            _observe(self.balance, res, worker, read, self.costs.num_workers)
        t_end = now + prefill + decode
        if old:
            self.gaps.append((t_end - now, old))
        if worker.size > old:
            self.gaps.append((decode, worker.size - old))
        self._record(t_end, res, worker, kv, 1, worker.size + len(new), len(new), waiting, prefill)
        self._advance(1, done_now, t_end, now + prefill)
        return t_end

    def span(self, now: float, waiting: int) -> tuple[float, int]:
        """The steps up to the next end as one record: the running set is fixed, each step one
        token longer, so their times are the ends' (bisected until the midpoint is linear).
        -> (the last step's end, steps taken)."""
        trace = self.trace
        left = min(int(trace.output_len[i]) - self.seqs[i].generated for i in self.running)
        if left < SPAN_MIN:
            return now, 0
        res_first, res_last = self._decode(0), self._decode(left - 1)
        total, gaps = self._span_times(0, left - 1, res_first, res_last)
        _, worker, kv, read = self._rows(left // 2)
        first, last = gaps[0], gaps[-1]
        self.gaps += [(first, worker.size * (left // 2)), (last, worker.size * (left - left // 2))]
        t_end = now + float(total[0])
        # the balance learns by moving averages: it hears the span in up to SPAN_OBSERVED pieces,
        # each its middle step's times (on the ends' line) counted as many times as it has steps
        edges = np.unique(np.linspace(0, left, min(left, SPAN_OBSERVED) + 1).round().astype(np.int64))
        for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
            mid = (a + b - 1) // 2
            res = res_first + (res_last - res_first) * (mid / (left - 1))
            _observe(self.balance, res, worker, self._rows(mid)[3], self.costs.num_workers, b - a)
        self._record(t_end, total, worker, kv, left, worker.size * left, 0, waiting, 0.0)
        self._advance(left, [], t_end, t_end)
        return t_end, left

    def _span_times(self, a: int, b: int, res_a: np.ndarray, res_b: np.ndarray) -> tuple[np.ndarray, list]:
        """Sum of the results of steps a..b (ahead of now) and the step times at its ends, bisected
        where the midpoint's time leaves the ends' line (the bound side switches inside)."""
        if b - a >= 2:
            mid = (a + b) // 2
            res_m = self._decode(mid)
            line = res_a[0] + (res_b[0] - res_a[0]) * (mid - a) / (b - a)
            if abs(res_m[0] - line) > SPAN_TOL * line:
                lo, g_lo = self._span_times(a, mid, res_a, res_m)
                hi, g_hi = self._span_times(mid + 1, b, self._decode(mid + 1), res_b)
                return lo + hi, g_lo + g_hi
        return (res_a + res_b) * ((b - a + 1) / 2.0), [float(res_a[0]), float(res_b[0])]

    def _record(self, t_end, res, worker, kv, span, tokens, admitted, waiting, prefill) -> None:
        W, P, tier = self.costs.num_workers, self.cfg.rworkers, self.tier
        held = np.bincount(worker, weights=kv, minlength=W)
        self.kv_held.append(held[:P])
        tier_busy = float(res[4 + tier]) if tier >= 0 else 0.0
        for k, v in zip(STEP_KEYS, (t_end, worker.size, tokens, admitted, waiting, prefill, float(res[0]),
                                    float(res[1]), float(res[2]), float(res[3]), tier_busy,
                                    float(held[tier]) if tier >= 0 else 0.0, span)):
            self.rec[k].append(v)
        self.r_busy.append(res[4:4 + P])

    def _advance(self, tokens: int, done_now: list[int], t_end: float, prefill_end: float) -> None:
        """Every running sequence `tokens` longer; those at their trace's length end."""
        seqs, trace = self.seqs, self.trace
        for i in self.running:
            seqs[i].generated += tokens
        finished = done_now + [i for i in self.running if seqs[i].generated >= trace.output_len[i]]
        for i in finished:
            self.finish_s[i] = t_end if seqs[i].generated > 1 else prefill_end
            self.placement.release(seqs[i])
            controller_observe(self.controller, seqs[i].generated, trace.output_len[i] < trace.max_tokens[i])
        self.running = [i for i in self.running if seqs[i].generated < trace.output_len[i]]

    def result(self) -> SimRun:
        P = self.cfg.rworkers
        steps = {k: np.asarray(v) for k, v in self.rec.items()}
        steps["span"] = steps["span"].astype(np.int64)
        steps["r_busy_s"] = np.asarray(self.r_busy, np.float64).reshape(len(self.r_busy), P)      # [T, P]
        steps["kv_tokens"] = np.asarray(self.kv_held, np.float64).reshape(len(self.kv_held), P)  # [T, P]
        g = np.asarray(self.gaps, dtype=np.float64).reshape(-1, 2)
        return SimRun(steps=steps, admitted_step=self.admitted_step, finish_s=self.finish_s, gap_s=g[:, 0],
                      gap_count=g[:, 1].astype(np.int64), admission=self.controller.describe())


def _balance(placement: Placement, costs: Costs, cfg: SimConfig) -> tuple[StepBalance, StepBalance | None]:
    """As the engine builds it: the balance (learning from every step), and it as the gate and
    placement's step model where a tier sits beside the R-workers (else None)."""
    tier = costs.tier
    balance = StepBalance(placement, cfg.depth, tier if tier >= 0 else None,
                          fixed_s=(costs.r_call_s * costs.layers * cfg.depth).tolist(), speeds_known=tier >= 0,
                          trip=costs.trip() if tier >= 0 and cfg.rworkers else None)
    return balance, (balance.attach() if cfg.balance and tier >= 0 else None)


def _observe(balance: StepBalance, res: np.ndarray, worker: np.ndarray, read: np.ndarray, W: int,
             repeat: int = 1) -> None:
    """A simulated decode step to the balance, as the engine hands it a measured one: the S-side's
    busy time (S-part, head and the tier's attention), per worker its KV tokens and attention
    seconds, and the S-worker's wait for the R-workers (the step less its busy time)."""
    tokens = np.bincount(worker, weights=read, minlength=W)                            # [W]
    attend = np.asarray(res[4:4 + W], np.float64)                                      # [W]
    balance.observe(int(worker.size), float(res[1]), tokens.tolist(), attend.tolist(), None,
                    max(float(res[0]) - float(res[1]), 0.0), repeat)


def controller_observe(controller, generated: int, stopped: bool) -> None:
    observe = getattr(controller, "observe_finished", None)
    if observe is not None:
        observe(int(generated), bool(stopped))


def _admit(controller, placement: Placement, balance: StepBalance | None, seqs: list, trace: Trace,
           queue: np.ndarray, pairs: np.ndarray, running: list[int], cfg: SimConfig, step: int,
           capacity: float) -> tuple[list[int], bool]:
    """Scheduler.schedule_prefill without chunked prefill: the controller's k, then the balance,
    placement and the prefill token budget (the first admitted always, the rest while they fit).
    -> (admitted, held back: the batch limit or memory stopped the queue's head, which nothing but
    a sequence's end can change)."""
    if not queue.size:
        return [], False
    room = cfg.max_batch - len(running)
    waiting = pairs[:max(HEAD_WINDOW, cfg.max_batch)]                  # [k, 2] a view: no copy per step
    run = [(seqs[i].kv_len, seqs[i].max_tokens - seqs[i].generated, seqs[i].generated) for i in running]
    if balance is not None:
        follow_balance(controller, balance, waiting, cfg.max_batch)
    k = min(controller.admit(step, waiting, run, capacity), room)
    if room <= 0:
        return [], True
    admitted, tokens = [], 0
    for i in queue[:max(k, 0)].tolist():
        rows = int(trace.prompt_len[i])
        if admitted and tokens + rows > cfg.max_prefill_tokens:
            break
        if balance is not None and not balance.admits(seqs[i]):
            break
        if placement.place(seqs[i]) is None:
            return admitted, True
        admitted.append(i)
        tokens += rows
    return admitted, False


def weighted_percentile(values: np.ndarray, counts: np.ndarray, q: float) -> float:
    """np.percentile(np.repeat(values, counts), q) (linear interpolation) without the repeat."""
    total = int(counts.sum())
    if total == 0:
        return math.nan
    order = np.argsort(values, kind="mergesort")
    v, c = values[order], np.cumsum(counts[order])
    pos = q / 100 * (total - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    at = np.searchsorted(c, [lo, hi], side="right")          # the value holding each 0-based rank
    return float(v[at[0]] + (v[at[1]] - v[at[0]]) * (pos - lo))
