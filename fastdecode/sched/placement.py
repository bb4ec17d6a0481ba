"""Which R-worker holds a new sequence's KV-cache, and how much of its memory a sequence reserves.

A sequence goes to the worker with the lowest projected KV load relative to its bandwidth,
never past that worker's capacity. Two reservation policies (`--kv-reserve`):

- full (default): a sequence reserves its worst case (prompt + max_tokens, rounded up to whole
  pages) at admission, so an admitted sequence can never run a worker out of memory; when nothing
  fits the sequence waits.
- grow: a sequence reserves the pages it has filled plus the one its next token goes to, and
  grows a page at a time. Admission keeps one page of headroom per resident sequence. When a
  worker has no page left for a growing sequence, the scheduler preempts the youngest sequences
  there (vLLM's recompute preemption); the oldest always progresses, so every sequence finishes.

With the S-worker's own KV tier beside the R-workers (rpart/tiered.py) the workers' speeds are
measured and a sequence goes where the step would end earliest: the tier's attention adds to the
S-part's time (`base_s`), the R-workers' runs beside it. The tier keeps a windowed layer's pages
(`frees_windows` False), so it is charged their full length.

Shared prefixes (engine/prefix_cache.py): a sequence placed with `shared_tokens` starts from that
many tokens (whole pages) of another sequence's pages on the same worker, so it reserves and
loads only the rest; the shared pages count once, with the sequence that filled them. When that
one ends while others still read its pages, the prefix cache keeps them charged (`set_lent`)
until the last reader ends.

Sliding windows (`windows`: keys per layer, 0 for a full layer): a worker's store frees a
windowed layer's pages once they fall out of the window and never holds more than the window's
pages plus one there, so a sequence is charged, per layer, the pages it can hold live, averaged
over the layers (in tokens of a full-attention layer, what the capacity counts). A Gemma-style
model with 5 of 6 layers sliding holds a fraction of a full model's bytes at long context.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:        # annotations only: `fastdecode plan` and `report` start without torch
    from fastdecode.engine.sequence import Sequence
    from fastdecode.rpart.base import WorkerInfo

RESERVE_POLICIES = ("full", "grow")     # generate's --kv-reserve
OVERFLOW_S = 1e9                        # added to an overflow-only worker's cost: any worker with room comes first
OWN_TIE = 1e-6                          # with a step model: the worker's own end time breaks ties of the step's


def grow_overhead_tokens(page_tokens: int) -> float:
    """What a growing sequence holds beyond its length: its last page half full, the next
    token's slot, a page of admission headroom (what `place` keeps free per resident sequence)."""
    return (3 * max(int(page_tokens), 1) + 1) / 2


class Placement:
    def __init__(self, workers: list[WorkerInfo], kv_bytes_per_token: int,
                 bandwidth: list[float] | None = None, policy: str = "full", windows: tuple[int, ...] = ()):
        if policy not in RESERVE_POLICIES:
            raise ValueError(f"kv reservation policy must be one of {RESERVE_POLICIES}, got {policy!r}")
        self.policy = policy
        self.windows = tuple(int(w) for w in windows) if any(windows) else ()
        self.frees_windows = [w.frees_windows for w in workers]     # else a windowed layer is charged in full
        self.page = [max(w.page_tokens, 1) for w in workers]
        self.capacity_tokens = [w.capacity_bytes // kv_bytes_per_token for w in workers]
        # each worker's speed, KV tokens (all layers) read per second when measured, else equal; and
        # what its step carries besides its own attention, seconds: the S-part, for the S-worker's
        # own KV tier, whose attention runs on the S-worker's critical path (0 for the R-workers,
        # whose attention runs beside the S-part in the pipeline)
        self.bandwidth = bandwidth or [1.0] * len(workers)
        self.base_s = [0.0] * len(workers)
        self.step_model = None                    # a StepBalance: cost() is the step's time (sched/balance.py)
        self.overflow_only = [False] * len(workers)   # a worker taken only when no other has room
                                                      # (a tier whose S-part time is not measured yet)
        self.reserved = [0] * len(workers)        # tokens reserved by resident sequences (whole pages)
        self.resident = [0] * len(workers)        # sequences resident on each worker
        self.load = [0.0] * len(workers)          # projected tokens: prompt + half the generation
        self.placed = [0] * len(workers)          # sequences placed on each worker so far (the report's)
        self._held: dict[int, int] = {}           # seq_id -> tokens it reserves now (its own pages)
        self._shared: dict[int, int] = {}         # seq_id -> tokens it reads from another's pages
        self._lent: dict[object, tuple[int, int]] = {}   # key -> (worker, tokens) of an ended
                                                         # sequence's pages that others still read

    def _pages(self, w: int, tokens: int) -> int:
        """tokens rounded up to whole pages of worker w."""
        return math.ceil(tokens / self.page[w]) * self.page[w]

    def _charge(self, w: int, tokens: float) -> int:
        """Capacity (tokens of all layers) a sequence of `tokens` positions takes on worker w:
        whole pages per layer, a windowed layer at most the pages its window keeps live."""
        pages = math.ceil(tokens / self.page[w])
        if not self.windows or not self.frees_windows[w]:
            return pages * self.page[w]
        live = [pages if win == 0 else min(pages, math.ceil(win / self.page[w]) + 1) for win in self.windows]
        return math.ceil(sum(live) * self.page[w] / len(live))

    def live_tokens(self, w: int, tokens: float) -> float:
        """Tokens of all layers a sequence of `tokens` positions keeps live on average (the load
        it puts on a worker's reads): a windowed layer's window and a page at most."""
        if not self.windows:
            return tokens
        return sum(tokens if win == 0 else min(tokens, win + self.page[w]) for win in self.windows) / len(self.windows)

    def _bound(self, w: int, seq: Sequence) -> int:
        return self._pages(w, seq.total_len_bound)

    def _initial(self, w: int, seq: Sequence) -> int:
        """What a sequence reserves when placed: its worst case, or (grow) what its prefill fills
        plus room for the next token."""
        return self._bound(w, seq) if self.policy == "full" else self._pages(w, seq.kv_len + 1)

    def projected_load(self, seq: Sequence, w: int) -> float:
        """Tokens (all layers) seq would put on worker w's reads over its life, on average:
        its prompt and half its generation bound, a windowed layer's window at most."""
        return self.live_tokens(w, seq.prompt_len + seq.max_tokens / 2)

    def _projected(self, seq: Sequence, w: int) -> float:
        return self.projected_load(seq, w) - self._shared.get(seq.seq_id, 0)

    def fits_anywhere_alone(self, seq: Sequence) -> bool:
        """False if no worker could hold this sequence's worst case even when empty (a request error)."""
        return any(self._charge(w, self._bound(w, seq)) <= cap for w, cap in enumerate(self.capacity_tokens))

    def cost(self, w: int, seq: Sequence, shared_tokens: int = 0) -> float:
        """When worker w's part of a step would end with seq on it: what else its step carries,
        then its projected load at its bandwidth (the lower, the better: the step ends earliest).
        With a step model (sched/balance.py) the whole step's time comes first: seq goes where the
        step grows least, and among places that leave it as it is, where its worker ends earliest."""
        return self._costs(seq, (w,), shared_tokens)[w]

    def _costs(self, seq: Sequence, workers, shared_tokens: int) -> dict[int, float]:
        """cost() of every worker in `workers` (the step model's sums taken once)."""
        extra = [self.projected_load(seq, w) - shared_tokens for w in range(len(self.load))]
        own = {w: self.base_s[w] + (self.load[w] + extra[w]) / self.bandwidth[w] for w in workers}
        if self.step_model is None:
            return own
        steps = self.step_model.times_with(extra)
        return {w: steps[w] + OWN_TIE * own[w] for w in workers}

    def set_speeds(self, tokens_per_s: list[float]) -> None:
        """Measured speeds (KV tokens of all layers read per second), one per worker."""
        if len(tokens_per_s) != len(self.bandwidth) or not all(b > 0 for b in tokens_per_s):
            raise ValueError(f"placement: one positive speed per worker, got {tokens_per_s}")
        self.bandwidth = [float(b) for b in tokens_per_s]

    def best(self, seq: Sequence, workers=None, shared_tokens: int = 0) -> int | None:
        """The worker (of `workers`, default all) with room for seq and the lowest cost; None: none has room."""
        best, best_cost = None, math.inf
        roomy = []
        for w in range(len(self.capacity_tokens)) if workers is None else workers:
            cap = self.capacity_tokens[w]
            need = self._charge(w, self._initial(w, seq)) - shared_tokens
            if self.policy == "grow":       # it must be able to finish here alone; headroom for the others
                if self._charge(w, self._bound(w, seq)) > cap:
                    continue
                need += self.resident[w] * self.page[w]
            if self.reserved[w] + need > cap:
                continue
            roomy.append(w)
        costs = self._costs(seq, roomy, shared_tokens) if roomy else {}
        for w in roomy:
            cost = costs[w] + (OVERFLOW_S if self.overflow_only[w] else 0.0)
            if cost < best_cost:
                best, best_cost = w, cost
        return best

    def place(self, seq: Sequence, worker: int | None = None, shared_tokens: int = 0) -> int | None:
        """Put seq on the best worker (or on `worker` only) if one has room; -> it, or None.
        shared_tokens: whole pages of another sequence on `worker` that seq starts from."""
        best = self.best(seq, None if worker is None else (worker,), shared_tokens)
        if best is None:
            return None
        held = self._initial(best, seq) - shared_tokens
        self._held[seq.seq_id] = held
        self._shared[seq.seq_id] = shared_tokens
        self.reserved[best] += self._charge(best, held)
        self.resident[best] += 1
        self.placed[best] += 1
        self.load[best] += self._projected(seq, best)
        seq.worker = best
        return best

    def needs_growth(self, seq: Sequence) -> bool:
        """grow: the sequence's next token would not fit in what it reserves."""
        return self.policy == "grow" and seq.kv_len + 1 > self._held[seq.seq_id] + self._shared[seq.seq_id]

    def grow(self, seq: Sequence) -> bool:
        """grow: reserve room for the sequence's next token on its worker; False if the worker is full."""
        w = seq.worker
        held = self._pages(w, seq.kv_len + 1) - self._shared[seq.seq_id]
        extra = self._charge(w, held) - self._charge(w, self._held[seq.seq_id])
        if self.reserved[w] + extra > self.capacity_tokens[w]:
            return False
        self.reserved[w] += extra
        self._held[seq.seq_id] = held
        return True

    def release(self, seq: Sequence) -> None:
        w = seq.worker
        self.reserved[w] -= self._charge(w, self._held.pop(seq.seq_id))
        self.resident[w] -= 1
        self.load[w] -= self._projected(seq, w)
        del self._shared[seq.seq_id]

    def held_tokens(self, seq: Sequence) -> int:
        """KV tokens the sequence reserves on its worker now, its own pages (whole pages; 0 if not placed)."""
        return self._held.get(seq.seq_id, 0)

    def shared_tokens(self, seq: Sequence) -> int:
        """Tokens of another sequence's pages it reads (0: none, or not placed)."""
        return self._shared.get(seq.seq_id, 0)

    def store_tokens(self, seq: Sequence) -> int:
        """KV tokens its worker's store reserves for it: its shared pages (already held) and its own."""
        return self.held_tokens(seq) + self.shared_tokens(seq)

    def set_lent(self, key: object, worker: int, tokens: int) -> None:
        """Keep `tokens` of an ended sequence's pages charged on `worker` under `key` while others
        read them (0: release them)."""
        old = self._lent.pop(key, (worker, 0))[1]
        self.reserved[worker] += tokens - old
        if tokens:
            self._lent[key] = (worker, tokens)

    def seq_overhead_tokens(self) -> float:
        """KV tokens a growing sequence holds beyond its length, on average (grow: its last page
        half full, the next token's slot, a page of admission headroom); 0 under full, whose
        reservation placement itself bounds."""
        return grow_overhead_tokens(max(self.page)) if self.policy == "grow" else 0.0

    def total_capacity_tokens(self) -> int:
        return sum(self.capacity_tokens)

    def free_tokens(self) -> int:
        return sum(c - r for c, r in zip(self.capacity_tokens, self.reserved))
