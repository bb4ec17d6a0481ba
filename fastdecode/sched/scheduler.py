"""Continuous batching: which waiting sequences start (prefill) this step, and who is running.

Admission is delegated to a controller from admission.py with one method,
`admit(step, waiting, running, capacity_tokens) -> k` (admit the first k waiting, FIFO), so the
load-stabilizing controller and plain FIFO plug in alike; a controller that learns generation
lengths also hears of each finished sequence (observe_finished). Placement then finds each admitted
sequence an R-worker; a sequence that fits nowhere right now waits (FIFO order is kept).
Under `--kv-reserve grow`, `make_room` preempts the youngest sequences of a worker that has no
page left for an older one's next token; they go back to the head of the queue with what they
generated and are prefilled again (prompt + output) when re-admitted.
"""
from __future__ import annotations

from collections import deque
from itertools import islice

from fastdecode.engine.sequence import Sequence, Status
from fastdecode.sched.admission import HEAD_WINDOW
from fastdecode.sched.placement import Placement


class Scheduler:
    def __init__(self, admission, placement: Placement, max_batch: int, max_prefill_tokens: int):
        self.admission = admission
        self.placement = placement
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule_prefill(self, step: int) -> list[Sequence]:
        """Sequences to prefill now; they are placed and counted as running from here on."""
        if not self.waiting:
            return []
        # the head of the queue is all a controller reads (it admits a prefix of at most
        # max_batch, estimates from HEAD_WINDOW); converting a 100k queue every step would not pay
        head = islice(self.waiting, max(HEAD_WINDOW, self.max_batch))
        waiting = [(s.kv_len, s.max_tokens - len(s.output_ids)) for s in head]
        running = [(s.kv_len, s.max_tokens - len(s.output_ids), len(s.output_ids)) for s in self.running]
        k = self.admission.admit(step, waiting, running, self.placement.total_capacity_tokens())
        k = min(k, self.max_batch - len(self.running))
        chosen, tokens = [], 0
        while self.waiting and len(chosen) < k:
            seq = self.waiting[0]
            if chosen and tokens + seq.kv_len > self.max_prefill_tokens:
                break                       # the rest waits for the next step's prefill
            if self.placement.place(seq) is None:
                break                       # no worker has room now; keep FIFO order
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.start_step = step
            chosen.append(seq)
            tokens += seq.kv_len
        self.running.extend(chosen)
        return chosen

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
                self.placement.release(victim)
                victim.status = Status.WAITING
                preempted.append(victim)
                if victim is seq:
                    break
        if preempted:
            self.running = [s for s in self.running if s.status is not Status.WAITING]
            self.waiting.extendleft(sorted(preempted, key=lambda s: -s.seq_id))
            self.num_preemptions += len(preempted)
        return preempted

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.placement.release(seq)
        observe = getattr(self.admission, "observe_finished", None)
        if observe is not None and seq.finish_reason is not None:   # not when aborted by an error
            observe(len(seq.output_ids), seq.finish_reason == "stop")

    def drop_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.status is Status.FINISHED]
        if done:
            self.running = [s for s in self.running if s.status is not Status.FINISHED]
        return done
