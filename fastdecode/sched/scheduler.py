"""Continuous batching: which waiting sequences start (prefill) this step, and who is running.

Admission is delegated to a controller from admission.py with one method,
`admit(step, waiting, running, capacity_tokens) -> k` (admit the first k waiting, FIFO), so the
load-stabilizing controller and plain FIFO plug in alike; a controller that learns generation
lengths also hears of each finished sequence (observe_finished). Placement then finds each admitted
sequence an R-worker; a sequence that fits nowhere right now waits (FIFO order is kept).
With a token budget per step (`--max-num-batched-tokens`, vLLM's chunked prefill) a step's rows
are the running sequences' decode rows first, then prompt chunks in the budget left: a prompt
longer than that is prefilled over several steps (PREFILLING until its last chunk), so decode never
waits for a whole long prompt. A request asking for prompt_logprobs is prefilled in one piece.
Under `--kv-reserve grow`, `make_room` preempts the youngest sequences of a worker that has no
page left for an older one's next token; they go back to the head of the queue with what they
generated and are prefilled again (prompt + output) when re-admitted.
Recomputing a sequence (preempted, or continued from a stop's save: it has output already) never
holds decode up: without a token budget such sequences are re-prefilled in chunks of
max_prefill_tokens / RECOMPUTE_SHARE beside the running sequences' decode rows, as chunked prefill
is, and they wait ahead of fresh prompts, the fewest tokens to recompute first, so the batch
refills with interrupted work soonest and decodes while the rest is recomputed.
With a prefix cache (engine/prefix_cache.py) a sequence whose prompt starts with whole pages another
holds on an R-worker is placed there and prefills only the rest; admission counts it so.
With a balance (sched/balance.py) a sequence starts only while it raises tokens/s: the head of the
queue waits, even with memory free, once one more sequence would slow the step by more than it
adds; the stabilized schedule's target batch follows the balance point.
"""
from __future__ import annotations

from collections import Counter, deque
from itertools import islice
from typing import TYPE_CHECKING

from fastdecode.sched.admission import HEAD_WINDOW
from fastdecode.sched.balance import StepBalance, follow_balance
from fastdecode.sched.placement import Placement
from fastdecode.sched.status import Status

if TYPE_CHECKING:                 # the engine's types, named in annotations only: sched/ sits below engine/
    from fastdecode.engine.prefix_cache import PrefixCache
    from fastdecode.engine.sequence import Sequence

RECOMPUTE_SHARE = 4     # a step re-prefills at most max_prefill_tokens / this of recomputed sequences


def recomputed(seq: Sequence) -> bool:
    """Whether seq's prefill recomputes K/V of its own output (preempted, or continued from a save)."""
    return bool(seq.output_ids)


def splittable(seq: Sequence) -> bool:
    """Whether seq's prompt may be prefilled in chunks: not when it asks for prompt_logprobs
    (those come from the last layer over the whole prompt at once)."""
    return seq.request.params.prompt_logprobs is None


class Scheduler:
    def __init__(self, admission, placement: Placement, max_batch: int, max_prefill_tokens: int,
                 max_num_batched_tokens: int | None = None, prefix: PrefixCache | None = None,
                 balance: StepBalance | None = None):
        self.admission = admission
        self.placement = placement
        self.balance = balance          # None: memory alone bounds the batch
        self.prefix = prefix            # shared prompt prefixes (None: every prompt prefills in full)
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens      # None: whole prompts, prefill first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preempted_on: Counter[int] = Counter()      # worker -> preemptions there

    def add(self, seq: Sequence) -> None:
        if recomputed(seq):
            self.waiting.insert(self._recompute_slot(seq), seq)
        else:
            self.waiting.append(seq)
        if self.prefix is not None:
            self.prefix.queued(seq)

    def _own_tokens(self, seq: Sequence, waiting: bool) -> int:
        """KV tokens of its own a sequence holds (waiting: would hold if placed now): a shared
        prefix counts with the sequence that filled it."""
        if self.prefix is None:
            return seq.kv_len
        return seq.kv_len - (self.prefix.shareable(seq) if waiting else self.placement.shared_tokens(seq))

    def _place(self, seq: Sequence) -> int | None:
        return self.placement.place(seq) if self.prefix is None else self.prefix.place(seq)

    def _release(self, seq: Sequence) -> None:
        self.placement.release(seq)
        if self.prefix is not None:
            self.prefix.released(seq)

    def _recompute_slot(self, seq: Sequence) -> int:
        """Where a recomputed sequence joins the queue: among the recomputed ones at its head, after
        those with no more to recompute than it, before every fresh prompt."""
        if not self.waiting or recomputed(self.waiting[-1]) and self.waiting[-1].kv_len <= seq.kv_len:
            return len(self.waiting)
        for i, other in enumerate(self.waiting):
            if not recomputed(other) or other.kv_len > seq.kv_len:
                return i
        return len(self.waiting)

    def step_budget(self) -> int | None:
        """This step's rows (decode + prompt chunks): --max-num-batched-tokens; else, while a
        recomputed sequence waits at the head or is part prefilled, the decode rows and a chunk
        of max_prefill_tokens / RECOMPUTE_SHARE; else None (whole prompts, prefill first)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if (self.waiting and recomputed(self.waiting[0])) or \
                any(s.status is Status.PREFILLING for s in self.running):
            decoding = sum(1 for s in self.running if s.status is Status.RUNNING)
            return decoding + max(1, self.max_prefill_tokens // RECOMPUTE_SHARE)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule_prefill(self, step: int) -> list[Sequence]:
        """Sequences to prefill now, each up to its `prefill_to`; they are placed and counted as
        running from here on (PREFILLING while chunks of their prompt remain)."""
        budget = self.step_budget()
        chosen = []
        if budget is not None:
            budget -= sum(1 for s in self.running if s.status is Status.RUNNING)
            for seq in self.running:                 # prefills in progress go on first, oldest first
                if seq.status is Status.PREFILLING and budget > 0:
                    budget -= self._chunk(seq, budget)
                    chosen.append(seq)
            if budget <= 0:
                return chosen
        if not self.waiting:
            return chosen
        # the head of the queue is all a controller reads (it admits a prefix of at most
        # max_batch, estimates from HEAD_WINDOW); converting a 100k queue every step would not pay
        head = islice(self.waiting, max(HEAD_WINDOW, self.max_batch))
        room = self.max_batch - len(self.running)          # the candidates: their shared prefixes count
        waiting = [(self._own_tokens(s, True) if i < room else s.kv_len, s.max_tokens - len(s.output_ids))
                   for i, s in enumerate(head)]
        running = [(self._own_tokens(s, False), s.max_tokens - len(s.output_ids), len(s.output_ids))
                   for s in self.running]
        if self.balance is not None:
            follow_balance(self.admission, self.balance, waiting, self.max_batch)
        k = self.admission.admit(step, waiting, running, self.placement.total_capacity_tokens())
        k = min(k, self.max_batch - len(self.running))
        admitted, tokens = [], 0
        while self.waiting and len(admitted) < k:
            seq = self.waiting[0]
            rows = self._own_tokens(seq, True)       # a shared prefix is not prefilled again
            if budget is None and admitted and tokens + rows > self.max_prefill_tokens:
                break                       # the rest waits for the next step's prefill
            if budget is not None and budget <= 0:
                break
            if budget is not None and not splittable(seq) and seq.kv_len > budget and (chosen or admitted):
                break                       # prefilled in one piece: waits for a step with room
            if self.balance is not None and not self.balance.admits(seq):
                break                       # one more would slow the step by more than it adds
            if self._place(seq) is None:
                break                       # no worker has room now (or its prefix is being prefilled)
            self.waiting.popleft()
            seq.start_step = step
            if budget is None:
                seq.prefill_to, seq.status = seq.kv_len, Status.RUNNING
            else:
                budget -= self._chunk(seq, budget if splittable(seq) else seq.kv_len)
            admitted.append(seq)
            tokens += seq.kv_len - self.placement.shared_tokens(seq)
        self.running.extend(admitted)
        return chosen + admitted

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        """This step's chunk of seq's prompt, at most `budget` tokens; -> its size. The last chunk
        makes it RUNNING (it decodes in this step)."""
        take = min(seq.kv_len - seq.prefilled, budget)
        seq.prefill_to = seq.prefilled + take
        seq.status = Status.RUNNING if seq.prefill_to == seq.kv_len else Status.PREFILLING
        return take

    def make_room(self) -> list[Sequence]:
        """grow: reserve room for every running sequence's next token, oldest first, preempting the
        youngest sequences of a full worker (possibly the one growing). -> the preempted sequences,
        whose KV the caller frees; they wait at the head of the queue, oldest first."""
        preempted = []
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            if seq.status is not Status.RUNNING or not self.placement.needs_growth(seq):
                continue
            while not self.placement.grow(seq):
                victim = max((s for s in self.running if s.worker == seq.worker and s.status is Status.RUNNING),
                             key=lambda s: s.seq_id)
                self.preempted_on[victim.worker] += 1
                self._release(victim)
                victim.status = Status.WAITING
                preempted.append(victim)
                if victim is seq:
                    break
        if preempted:
            self.running = [s for s in self.running if s.status is not Status.WAITING]
            self.waiting.extendleft(sorted(preempted, key=lambda s: -s.seq_id))
            self.num_preemptions += len(preempted)
            for seq in preempted if self.prefix is not None else ():
                self.prefix.queued(seq)
        return preempted

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self._release(seq)
        observe = getattr(self.admission, "observe_finished", None)
        if observe is not None and seq.finish_reason is not None:   # not when aborted by an error
            observe(len(seq.output_ids), seq.finish_reason == "stop")

    def drop_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.status is Status.FINISHED]
        if done:
            self.running = [s for s in self.running if s.status is not Status.FINISHED]
        return done
