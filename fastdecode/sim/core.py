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
             "link_out_s", "link_back_s", "tier_busy_s", "tier_kv_tokens")


def simulate(costs: Costs, trace: Trace, cfg: SimConfig) -> SimRun:
    tier = costs.tier
    if cfg.rworkers < (0 if tier >= 0 else 1) or cfg.depth < 1 or cfg.max_batch < 1 or cfg.max_prefill_tokens < 1:
        raise ValueError("rworkers (0 only with the S-worker's own tier), depth, max_batch and max_prefill_tokens "
                         "must be >= 1")
    if cfg.rworkers != costs.rworkers:
        raise ValueError(f"the costs are for {costs.rworkers} R-workers, the job has {cfg.rworkers}")
    if cfg.max_batch >= costs.s_table.size:
        raise ValueError(f"max_batch {cfg.max_batch} exceeds the cost tables ({costs.s_table.size - 1})")
    n, P, W = len(trace), cfg.rworkers, costs.num_workers
    step_fn = step_function(cfg.use_numba)
    controller = make_admission(cfg)
    placement = Placement(costs.workers(), int(costs.kv_bytes_token), policy="full")
    if tier >= 0:           # as LLMEngine sets it up: measured speeds, the tier's S-part time still unknown
        placement.set_speeds(costs.speeds())
        placement.overflow_only[tier] = costs.profile.device_tier.kind == "local"
    balance, gate = _balance(placement, costs, cfg)
    capacity = placement.total_capacity_tokens()
    order = np.lexsort((np.arange(n), trace.arrival_s))          # FIFO: by arrival, then trace order
    seqs = [_Seq(i + 1, int(trace.prompt_len[i]), int(trace.max_tokens[i])) for i in range(n)]
    admitted_step, finish_s = np.full(n, -1, np.int64), np.full(n, -1.0)
    running: list[int] = []                                       # request indices, admission order
    rec = {k: [] for k in STEP_KEYS}
    r_busy, kv_held, gaps = [], [], []
    now, nxt, step = 0.0, 0, 0
    while (nxt < n or running) and step < cfg.max_steps:
        end = nxt + int(np.searchsorted(trace.arrival_s[order[nxt:]], now, side="right"))
        if not running and end == nxt:
            now = float(trace.arrival_s[order[nxt]])              # idle until the next request arrives
            continue
        step += 1
        new = _admit(controller, placement, gate, seqs, trace, order[nxt:end], running, cfg, step, capacity)
        nxt += len(new)
        admitted_step[new] = step
        sent = np.array([seqs[i].worker != tier for i in new], bool)
        prefill = costs.prefill_s(trace.prompt_len[new], sent) if new else 0.0
        for i in new:
            seqs[i].generated = 1
        done_now = [i for i in new if trace.output_len[i] <= 1]
        old = len(running)
        running += [i for i in new if trace.output_len[i] > 1]
        idx = np.array(running, np.int64)
        gen = np.array([seqs[i].generated for i in running], np.int64)
        worker = np.array([seqs[i].worker for i in running], np.int64)
        kv = trace.prompt_len[idx] + gen                                   # [m] tokens attended
        read = costs.read_tokens(kv)                                       # [m] tokens read per layer
        res = step_fn(kv, read, idx + 1, worker, cfg.depth, W, costs.layers, costs.s_table,
                      float(costs.head_table[idx.size]), costs.r_token_s, costs.r_call_s, costs.out_bytes_row,
                      costs.back_bytes_row, costs.link, costs.msg_bytes, costs.msg_time, tier)
        decode = float(res[0])
        tier_busy = float(res[4 + tier]) if tier >= 0 else 0.0
        if idx.size:
            _observe(balance, res, worker, read, W)
        t_end = now + prefill + decode
        if old:
            gaps.append((t_end - now, old))
        if idx.size > old:
            gaps.append((decode, idx.size - old))
        held = np.bincount(worker, weights=kv, minlength=W)
        kv_held.append(held[:P])
        for i in running:
            seqs[i].generated += 1
        finished = done_now + [i for i in running if seqs[i].generated >= trace.output_len[i]]
        for i in finished:
            finish_s[i] = t_end if seqs[i].generated > 1 else now + prefill
            placement.release(seqs[i])
            controller_observe(controller, seqs[i].generated, trace.output_len[i] < trace.max_tokens[i])
        running = [i for i in running if seqs[i].generated < trace.output_len[i]]
        for k, v in zip(STEP_KEYS, (t_end, idx.size, idx.size + len(new), len(new), end - nxt, prefill, decode,
                                    float(res[1]), float(res[2]), float(res[3]), tier_busy,
                                    float(held[tier]) if tier >= 0 else 0.0)):
            rec[k].append(v)
        r_busy.append(res[4:4 + P])
        now = t_end
    steps = {k: np.asarray(v) for k, v in rec.items()}
    steps["r_busy_s"] = np.asarray(r_busy, np.float64).reshape(len(r_busy), P)      # [T, P]
    steps["kv_tokens"] = np.asarray(kv_held, np.float64).reshape(len(kv_held), P)  # [T, P]
    g = np.asarray(gaps, dtype=np.float64).reshape(-1, 2)
    return SimRun(steps=steps, admitted_step=admitted_step, finish_s=finish_s, gap_s=g[:, 0],
                  gap_count=g[:, 1].astype(np.int64), admission=controller.describe())


def _balance(placement: Placement, costs: Costs, cfg: SimConfig) -> tuple[StepBalance, StepBalance | None]:
    """As the engine builds it: the balance (learning from every step), and it as the gate and
    placement's step model where a tier sits beside the R-workers (else None)."""
    tier = costs.tier
    balance = StepBalance(placement, cfg.depth, tier if tier >= 0 else None,
                          fixed_s=(costs.r_call_s * costs.layers * cfg.depth).tolist(), speeds_known=tier >= 0)
    return balance, (balance.attach() if cfg.balance and tier >= 0 else None)


def _observe(balance: StepBalance, res: np.ndarray, worker: np.ndarray, read: np.ndarray, W: int) -> None:
    """A simulated decode step to the balance, as the engine hands it a measured one: the S-side's
    busy time (S-part, head and the tier's attention), per worker its KV tokens and attention
    seconds, and the S-worker's wait for the R-workers (the step less its busy time)."""
    tokens = np.bincount(worker, weights=read, minlength=W)                            # [W]
    attend = np.asarray(res[4:4 + W], np.float64)                                      # [W]
    balance.observe(int(worker.size), float(res[1]), tokens.tolist(), attend.tolist(), None,
                    max(float(res[0]) - float(res[1]), 0.0))


def controller_observe(controller, generated: int, stopped: bool) -> None:
    observe = getattr(controller, "observe_finished", None)
    if observe is not None:
        observe(int(generated), bool(stopped))


def _admit(controller, placement: Placement, balance: StepBalance | None, seqs: list, trace: Trace,
           queue: np.ndarray, running: list[int], cfg: SimConfig, step: int, capacity: float) -> list[int]:
    """Scheduler.schedule_prefill without chunked prefill: the controller's k, then the balance,
    placement and the prefill token budget (the first admitted always, the rest while they fit).
    -> admitted."""
    if not queue.size:
        return []
    head = queue[:max(HEAD_WINDOW, cfg.max_batch)]
    waiting = list(zip(trace.prompt_len[head].tolist(), trace.max_tokens[head].tolist()))
    run = [(seqs[i].kv_len, seqs[i].max_tokens - seqs[i].generated, seqs[i].generated) for i in running]
    if balance is not None:
        follow_balance(controller, balance, waiting, cfg.max_batch)
    k = min(controller.admit(step, waiting, run, capacity), cfg.max_batch - len(running))
    admitted, tokens = [], 0
    for i in queue[:max(k, 0)].tolist():
        rows = int(trace.prompt_len[i])
        if admitted and tokens + rows > cfg.max_prefill_tokens:
            break
        if balance is not None and not balance.admits(seqs[i]):
            break
        if placement.place(seqs[i]) is None:
            break
        admitted.append(i)
        tokens += rows
    return admitted


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
