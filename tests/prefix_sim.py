"""The engine's step for the S-worker's prefix sharing, without a model: the real Scheduler,
Placement and PrefixCache drive a page-level model of the R-workers' stores (refcounted pages
that remember the token ids written into them), so a test can check after every step that

- every sequence's pages hold exactly its prompt and output tokens (a fork took the right pages);
- each worker's pages in use fit in what placement reserves there, and that in its capacity
  (shared pages counted once, and kept charged while anyone reads them after their filler ended);
- when everything has finished nothing is left: no page, no reservation, no entry, no kept K/V.

Used by tests/test_prefix_sharing.py. A step runs as LLMEngine.step / _mixed_step order them:
(grow, chunked: make room) schedule, prefill (forks first, prefix K/V kept for pending entries),
(grow, whole prompts: make room), decode one token each, random stops, free the finished.
"""
from __future__ import annotations

import random

from fastdecode.engine.prefix_cache import PrefixCache
from fastdecode.engine.sampling_params import SamplingParams
from fastdecode.engine.sequence import Request, Sequence, Status
from fastdecode.rpart.base import WorkerInfo
from fastdecode.sched.placement import Placement
from fastdecode.sched.scheduler import Scheduler

PAGE = 4           # tokens per page: small, so short prompts span several pages
LAYERS = 2


class PageStore:
    """One worker's store as pages: page id -> [token ids, refcount]; seq id -> its page ids."""

    def __init__(self):
        self.pages: dict[int, list] = {}
        self.seqs: dict[int, list[int]] = {}
        self.next_page = 0

    def _new_page(self) -> int:
        self.next_page += 1
        self.pages[self.next_page] = [[], 1]
        return self.next_page

    def fork(self, src: int, dst: int, tokens: int) -> None:
        assert dst not in self.seqs and src in self.seqs, (src, dst)
        assert tokens % PAGE == 0 and self.length(src) >= tokens, (src, tokens, self.length(src))
        self.seqs[dst] = self.seqs[src][:tokens // PAGE]
        for p in self.seqs[dst]:
            self.pages[p][1] += 1

    def append(self, seq: int, tokens: list[int]) -> None:
        pages = self.seqs.setdefault(seq, [])
        for t in tokens:
            if not pages or len(self.pages[pages[-1]][0]) == PAGE:
                pages.append(self._new_page())
            page = self.pages[pages[-1]]
            assert page[1] == 1, "an append wrote a shared page"
            page[0].append(t)

    def free(self, seq: int) -> None:
        for p in self.seqs.pop(seq):
            self.pages[p][1] -= 1
            if not self.pages[p][1]:
                del self.pages[p]

    def length(self, seq: int) -> int:
        return sum(len(self.pages[p][0]) for p in self.seqs.get(seq, ()))

    def tokens(self, seq: int) -> list[int]:
        return [t for p in self.seqs.get(seq, ()) for t in self.pages[p][0]]


class PrefixSim:
    def __init__(self, rng: random.Random, workers: int = 1, capacity_tokens: int = 4096, policy: str = "full",
                 budget: int | None = None, budget_tokens: int = 256, max_batch: int = 16):
        infos = [WorkerInfo(w + 1, "h", 1, "avx2", capacity_tokens * 8, page_tokens=PAGE) for w in range(workers)]
        self.placement = Placement(infos, kv_bytes_per_token=8, policy=policy)
        self.prefix = PrefixCache(PAGE, LAYERS, self.placement, budget_tokens)
        self.sched = Scheduler(AdmitAll(), self.placement, max_batch, 1 << 20, budget, self.prefix)
        self.stores = [PageStore() for _ in range(workers)]
        self.rng, self.step_no, self.next_id = rng, 0, 1
        self.kept_peak = 0
        self.forks = 0

    def add(self, prompt: list[int], max_tokens: int, n: int = 1, prompt_logprobs: int | None = None) -> None:
        req = Request(self.next_id, str(self.next_id), None, prompt,
                      SamplingParams(max_tokens=max_tokens, n=n, prompt_logprobs=prompt_logprobs), 0)
        for i in range(n):
            req.sequences.append(Sequence(self.next_id, req, i, max_tokens))
            self.sched.add(req.sequences[-1])
            self.next_id += 1

    def step(self, stop_p: float = 0.1) -> None:
        self.step_no += 1
        grow, chunked = self.placement.policy == "grow", self.sched.max_num_batched_tokens is not None
        if chunked:                                 # _mixed_step: room, then decode rows beside the chunks
            if grow:
                self._free(self.sched.make_room())
            decoding = [s for s in self.sched.running if s.status is Status.RUNNING]
            for s in self.sched.schedule_prefill(self.step_no):
                self._prefill(s)
        else:                                       # step: prefill, room, decode every running sequence
            for s in self.sched.schedule_prefill(self.step_no):
                self._prefill(s)
            if grow:
                self._free(self.sched.make_room())
            decoding = [s for s in self.sched.running if s.status is Status.RUNNING]
        for s in decoding:
            if s.status is Status.RUNNING:
                self._store(s).append(s.seq_id, [s.output_ids[-1]])     # decode: the newest token's K/V
                self._token(s, stop_p)
        self._free(self.sched.drop_finished())
        self.kept_peak = max(self.kept_peak, self.prefix.kept_tokens)
        self.check()

    def _store(self, s: Sequence) -> PageStore:
        return self.stores[s.worker]

    def _prefill(self, s: Sequence) -> None:
        """What the runner and its R-worker do with one sequence's chunk (ModelRunner._prefill_plan)."""
        start, end = s.prefilled, s.prefill_to or s.kv_len
        fork = self.prefix.take_fork(s)
        if fork is not None:
            self._store(s).fork(fork.source, s.seq_id, fork.tokens)
            assert fork.tokens == start and len(fork.kv) == LAYERS
            self.forks += 1
        t = self.prefix.capture_tokens(s)
        if start < t <= end:
            for layer in range(LAYERS):
                self.prefix.keep(s, layer, ("K", s.seq_id, t), ("V", s.seq_id, t))
        tokens = s.request.prompt_ids + s.output_ids[:-1]
        self._store(s).append(s.seq_id, tokens[start:end])
        done = end == s.kv_len
        s.prefilled, s.prefill_to = (0 if done else end), 0
        if done and not s.output_ids:
            self._token(s, 0.0)                     # the first token, from the prompt's last row

    def _token(self, s: Sequence, stop_p: float) -> None:
        s.output_ids.append(self.rng.randrange(1000, 2000))
        if len(s.output_ids) >= s.max_tokens or self.rng.random() < stop_p:
            s.finish_reason = "stop"
            self.sched.finish(s)

    def _free(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._store(s).free(s.seq_id)
            s.prefilled = s.prefill_to = 0

    def check(self) -> None:
        for s in self.sched.running:
            want = (s.request.prompt_ids + s.output_ids[:-1])[:s.kv_len if s.status is Status.RUNNING
                                                                 else s.prefilled]
            if s.status is Status.RUNNING or s.prefilled:
                assert self._store(s).tokens(s.seq_id) == want, f"sequence {s.seq_id} holds other tokens"
        for w, store in enumerate(self.stores):
            in_use = len(store.pages) * PAGE
            assert in_use <= self.placement.reserved[w] <= self.placement.capacity_tokens[w], \
                (w, in_use, self.placement.reserved[w])

    def run(self, stop_p: float = 0.1, max_steps: int = 5000) -> None:
        while self.sched.has_work():
            assert self.step_no < max_steps, "the simulated job does not end"
            self.step(stop_p)

    def assert_empty(self) -> None:
        p = self.prefix
        assert not any(st.pages or st.seqs for st in self.stores)
        assert self.placement.reserved == [0] * len(self.stores) and not self.placement._lent
        assert not p.entries and not p.cover and not p.joined and not p.donated and not p.forks
        assert p.kept_tokens == 0 and not p.interest


class AdmitAll:
    def admit(self, step, waiting, running, capacity):
        return len(waiting)


def family_prompts(rng: random.Random, families: int, count: int) -> list[list[int]]:
    """`count` prompts behind `families` shared heads of 1..4 pages (some with no head, some
    repeated whole), tails of 0..9 tokens: many partial pages and exact-page boundaries."""
    heads = [[rng.randrange(10, 900) for _ in range(PAGE * rng.randint(1, 4) + rng.randint(0, 3))]
             for _ in range(families)]
    out = []
    for _ in range(count):
        r = rng.random()
        if r < 0.15:
            out.append([rng.randrange(10, 900) for _ in range(rng.randint(1, 12))])
        elif r < 0.3 and out:
            out.append(list(rng.choice(out)))
        else:
            out.append(rng.choice(heads) + [rng.randrange(10, 900) for _ in range(rng.randint(0, 9))])
    return out
