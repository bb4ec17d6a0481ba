"""LLMEngine: requests in, finished requests out; `step()` = schedule -> run -> postprocess."""
from __future__ import annotations

import hashlib
import sys
import time

import numpy as np
import torch

from fastdecode.engine import continuation, rpart_setup, spart_setup
from fastdecode.engine.assembly import adopt, build
from fastdecode.engine.args import EngineArgs
from fastdecode.engine.kv_reload import Reloader
from fastdecode.engine.outputs import request_output
from fastdecode.engine.prefix_cache import PrefixCache
from fastdecode.engine.request_checks import Checked, RequestChecks, RequestError
from fastdecode.engine.rpart_setup import OutOfMemory
from fastdecode.engine.runner import ModelRunner
from fastdecode.engine.sampling_params import RequestMetrics, RequestOutput, SamplingParams
from fastdecode.engine.sequence import Request, Sequence, Status
from fastdecode.engine.stats import Reservoir, StepRecorder
from fastdecode.launch.ranks import launched_rank
from fastdecode.model.names import ServedModel, served_model
from fastdecode.model.source import resolve_model
from fastdecode.model.tokenizer import TokenIdsOnly, Tokenizer
from fastdecode.model.weights import source_digest
from fastdecode.sched.admission import FifoAdmission, StabilizedAdmission
from fastdecode.sched.balance import StepBalance
from fastdecode.sched.placement import Placement
from fastdecode.sched.scheduler import Scheduler
from rworker.host import faults


class LLMEngine:
    def __init__(self, args: EngineArgs, comm=None, parallel=None):
        """comm: the S-worker's communicator (None: local mode); parallel: a tensor-parallel
        S-worker's side of the assembly (tp/engines.py makes such an engine)."""
        self.parallel = parallel
        adopt(self, build(args, comm, parallel))       # config, device, dtypes, model, tier, backend, ...
        args = self.args
        self.served: ServedModel = served_model(self.source, args.served_model_name)
        digest = source_digest(self.source) if self.source.kind == "gguf" else None
        tokenizer = resolve_model(args.tokenizer, args.tokenizer_revision) if args.tokenizer else None
        self.tokenizer = Tokenizer(self.source, digest, tokenizer, self.max_model_len) \
            if self.source.kind != "random" or tokenizer \
            else TokenIdsOnly(self.config.vocab_size)
        self.eos_ids = self.tokenizer.eos_token_ids(self.config.eos_token_ids)
        self.checks = RequestChecks(self.config.vocab_size, self.max_model_len, self.eos_ids,
                                    self.tokenizer.encode_text, args.max_logprobs, args.max_request_mem)
        if comm is not None and comm.Get_size() > 1 and not args.quiet:
            rpart_setup.log_roster(self)
        self.placement = Placement(self.backend.workers, self.kv_bytes_per_token, policy=args.kv_reserve,
                                   windows=self.variants.windows)
        self.tier_index = rpart_setup.place_by_tier_speeds(self)
        # learns each decode step's sides; with the S-worker's own tier beside the R-workers it also
        # places sequences and gates admissions (unless --no-balance)
        calls = self.config.num_layers * args.pipeline_depth          # kernel calls per worker and step
        self.balance = StepBalance(self.placement, args.pipeline_depth, self.tier_index,
                                   fixed_s=[w.attend_call_s * calls for w in self.backend.workers],
                                   speeds_known=self.tier_index is not None,     # measured with a tier only
                                   trip=rpart_setup.trip_prior(self))
        gated = args.balance and self.tier_index is not None      # two places to weigh (sched/balance.py)
        if gated:
            self.balance.attach()
        if not args.quiet:
            rpart_setup.log_tiers(self)
        self.prefix = self._make_prefix_cache()
        self.scheduler = Scheduler(self._make_admission(), self.placement, args.max_batch,
                                   args.max_prefill_tokens, args.max_num_batched_tokens, self.prefix,
                                   self.balance if gated else None)
        spart_setup.pack_weights(args, self.model)
        spart_setup.compile_spart(args, self.model)
        graphs = spart_setup.make_graphs(args, self.device, self.model, self.tp)
        self.runner = ModelRunner(self.model, self.backend, self.eos_ids, args.pipeline_depth, graphs) \
            if self.tp is None else parallel.runner(self, comm)
        self.runner.reserve_tokens, self.runner.prefix = self.placement.store_tokens, self.prefix   # pages at prefill
        if spart_setup.prefills_on_the_node(args, self.device, self.layout, self.node_cpus):
            self.runner.prefill_threads, self.runner.prefill_cpus = spart_setup.node_cores(self.node_cpus)
        self.recorder = StepRecorder(len(self.backend.workers))
        self.token_gaps = Reservoir()      # seconds between a sequence's consecutive tokens
        self.step_no, self._next_seq_id = 0, 1
        self.num_prompt_tokens = self.num_output_tokens = 0
        self.bound_output_tokens = 0       # finished sequences' tokens + unfinished ones' max_tokens
        self.num_recomputed_tokens = 0     # KV recomputed for preempted sequences (--kv-reserve grow)
        self.reload_kv = Reloader()        # a stop's saved KV, imported instead of recomputed (engine/kv_reload.py)
        self.pinned_bytes = 0              # what unfinished requests may hold on rank 0 (their estimates)
        self._noted_reservation = False

    def _make_prefix_cache(self) -> PrefixCache | None:
        """Shared prompt prefixes, unless turned off or a worker's store cannot fork (an older build,
        or sliding-window layers, whose early pages are freed as a sequence moves on)."""
        workers = self.backend.workers
        pages = {w.page_tokens for w in workers}
        if not self.args.prefix_sharing or not all(w.forks for w in workers) or len(pages) != 1 or pages == {1}:
            return None
        return PrefixCache(pages.pop(), self.config.num_layers, self.placement, self.args.prefix_kept_tokens)

    def tier_summary(self) -> dict:
        return rpart_setup.tier_summary(self)

    def prefix_summary(self) -> dict:
        """The run summary's prefix sharing figures (zeros when off)."""
        if self.prefix is None:
            return {"prefix_sharing": False, "prefix_hits": 0, "prefix_shared_tokens": 0, "prefix_kv_bytes_saved": 0}
        return {"prefix_sharing": True, **self.prefix.summary(self.kv_bytes_per_token)}

    def _make_admission(self):
        a = self.args
        if a.schedule == "fifo":
            return FifoAdmission(a.max_batch, worst_case=a.kv_reserve == "full")
        if a.schedule == "stabilized":
            return StabilizedAdmission(min(a.target_batch or a.max_batch, a.max_batch), a.admit_every, a.max_gen,
                                       learn_lengths=a.learn_lengths,
                                       seq_overhead_tokens=self.placement.seq_overhead_tokens())
        raise ValueError(f"schedule must be 'fifo' or 'stabilized', got {a.schedule!r}")

    def describe_model(self) -> str:
        """One line for the job's start: the architecture and the attention variants it runs."""
        c = self.config
        variants = c.attention_variants()
        return (f"model {c.model_type}: {c.num_layers} layers, {c.num_heads} query / {c.num_kv_heads} KV heads x "
                f"{c.head_dim}" + (f"; {variants}" if variants else "")
                + ("; prefix sharing off (sliding windows)" if self.variants.windowed and self.args.prefix_sharing
                   else ""))

    # ------------------------------------------------------------------ requests

    def request_seed(self, params: SamplingParams, request_id: str) -> int:
        if params.seed is not None:
            return params.seed & ((1 << 63) - 1)
        digest = hashlib.sha256(f"{self.args.seed}:{request_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> Checked:
        """What add_request checks, without queuing anything: raise RequestError if the request
        can never be served (request_checks.py, or more KV than any R-worker holds). Callers that
        queue several requests as one (a batch line's prompts) check them all first."""
        checked = self.checks.check(prompt_ids, params)
        self._check_capacity(prompt_ids, params, checked.max_tokens)
        return checked

    def _check_capacity(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        probe = Sequence(0, Request(0, "", None, prompt_ids, params, 0), 0, max_tokens)
        if not self.placement.fits_anywhere_alone(probe):     # every sample has this bound
            raise RequestError(f"the request needs {probe.total_len_bound} KV tokens, more than any R-worker "
                               f"can hold", code="kv_capacity_exceeded")

    def add_request(self, index: int, request_id: str, prompt: str | None, prompt_ids: list[int],
                    params: SamplingParams, meta: dict | None = None,
                    resume: continuation.RequestState | None = None) -> Request:
        """Queue a request; raise RequestError if it can never be served (check_request). With
        `resume` (a stop's save of it) its sequences continue from their saved tokens, prefilled as
        preempted ones are; one that does not fit the request is not used, the reason left in
        meta["resume_refused"]. A request whose every sequence had finished comes back finished."""
        checked = self.checks.check(prompt_ids, params)
        n_prompt, max_tokens = len(prompt_ids), checked.max_tokens
        if params.max_tokens is None and self.placement.policy == "full":     # said even if it cannot fit
            self._note_whole_context_reservation(request_id, n_prompt + max_tokens)
        self._check_capacity(prompt_ids, params, max_tokens)
        req = Request(index, request_id, prompt, list(prompt_ids), params,
                      self.request_seed(params, request_id), meta=meta or {}, arrival_step=self.step_no,
                      bad_words_ids=checked.bad_words_ids, pinned_bytes=checked.pinned_bytes,
                      allowed_ids=checked.allowed_ids)
        now = time.time()
        req.metrics = RequestMetrics(arrival_time=now, last_token_time=now)
        for i in range(params.n):
            req.sequences.append(Sequence(self._next_seq_id, req, i, max_tokens))
            self._next_seq_id += 1
        if resume is not None:
            refused = continuation.check(req, resume, self.config.vocab_size, self._check_stop)
            if refused is None:
                continuation.restore(req, resume)
            else:
                req.meta["resume_refused"] = refused
        for seq in req.sequences:
            if seq.status is Status.FINISHED:
                self.bound_output_tokens += len(seq.output_ids)
                continue
            self.scheduler.add(seq)
            self.bound_output_tokens += seq.max_tokens
        if not req.finished:
            self.pinned_bytes += req.pinned_bytes
        return req

    def _note_whole_context_reservation(self, request_id: str, bound: int) -> None:
        """Once per job: say so when requests without max_tokens reserve so much KV that fewer than
        --max-batch of them fit at once (a silent cause of a small batch on long-context models)."""
        fits = self.placement.total_capacity_tokens() // bound
        if self._noted_reservation or fits >= self.args.max_batch:
            return
        self._noted_reservation = True
        print(f"fastdecode: note: request {request_id!r} sets no max_tokens, so each of its sequences reserves "
              f"R-worker memory for the whole context ({bound} tokens); at that size {fits} fit at once, fewer "
              f"than --max-batch {self.args.max_batch}. Set max_tokens in the requests, pass a shorter "
              f"--max-model-len, or --kv-reserve grow (reserve as sequences grow, preempt when full) to run "
              f"more at once.", file=sys.stderr, flush=True)

    def expected_output_tokens(self) -> float:
        """Output tokens the requests added so far will have generated when all are done: the
        finished sequences' own, the unfinished ones' max_tokens, or, where the schedule learns
        generation lengths (sched/length_model.py) and has learnt them, their expected length."""
        lengths = getattr(self.scheduler.admission, "lengths", None)
        if lengths is None or not lengths.ready:
            return float(self.bound_output_tokens)
        seqs = [s for s in self.scheduler.running if s.status in (Status.RUNNING, Status.PREFILLING)] \
            + list(self.scheduler.waiting)
        generated = np.array([len(s.output_ids) for s in seqs], dtype=np.int64)     # [n]
        bound = np.array([s.max_tokens for s in seqs], dtype=np.int64)              # [n]
        return float(self.bound_output_tokens - (bound - lengths.expected_length(generated, bound)).sum())

    def tokens_left(self) -> tuple[np.ndarray, np.ndarray]:
        """Output tokens each unfinished sequence is expected to generate still, by max_tokens or
        the learnt lengths (as expected_output_tokens): (running and prefilling [r], waiting [w])."""
        lengths = getattr(self.scheduler.admission, "lengths", None)

        def left(seqs: list[Sequence]) -> np.ndarray:
            generated = np.array([len(s.output_ids) for s in seqs], dtype=np.int64)     # [n]
            bound = np.array([s.max_tokens for s in seqs], dtype=np.int64)              # [n]
            expected = lengths.expected_length(generated, bound) if lengths is not None and lengths.ready and seqs \
                else bound
            return np.maximum(expected - generated, 0)
        running = [s for s in self.scheduler.running if s.status in (Status.RUNNING, Status.PREFILLING)]
        return left(running), left(list(self.scheduler.waiting))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Request]:
        """Admit and prefill, decode one token for every running sequence, return finished requests.
        Out of memory (the GPU's, or the host's) ends the job with one line saying what to lower;
        the rows already written stay and a rerun resumes."""
        self.step_no += 1
        try:
            faults.check(launched_rank(), "step")   # a data-parallel group's S-worker: its world rank
            if self.scheduler.step_budget() is not None:       # chunked prefill, or recompute beside decode
                return self._mixed_step()
            return self._step()
        except (torch.OutOfMemoryError, MemoryError) as e:
            raise OutOfMemory(rpart_setup.oom_advice(self, e)) from e

    def _step(self) -> list[Request]:
        t0 = time.perf_counter()
        tokens_before = self.num_output_tokens
        finished: list[Request] = []
        new = self.scheduler.schedule_prefill(self.step_no)
        _note_scheduled(new)
        new = self.reload_kv(self, new)
        prefill = None
        if new:
            prefill = self._prefill(new, finished)
        if self.placement.policy == "grow":
            self.free_kv(self.scheduler.make_room())
        t_prefill = time.perf_counter() - t0
        running = [s for s in self.scheduler.running if s.status is Status.RUNNING]
        stats = None
        if running:
            seqs, tokens, stats = self.runner.decode(running)
            self._postprocess(seqs, tokens, finished)
        return self._end_step(t0, tokens_before, running, stats, t_prefill, prefill, finished)

    def _mixed_step(self) -> list[Request]:
        """Chunked prefill: the running sequences' decode rows and this step's prompt chunks in one
        pass through the layers (runner.mixed); a sequence whose last chunk is in it decodes from
        the next step on."""
        t0 = time.perf_counter()
        tokens_before = self.num_output_tokens
        finished: list[Request] = []
        if self.placement.policy == "grow":           # room for the decode rows' next tokens first
            self.free_kv(self.scheduler.make_room())
        running = [s for s in self.scheduler.running if s.status is Status.RUNNING]
        new = self.scheduler.schedule_prefill(self.step_no)
        _note_scheduled(new)
        new = self.reload_kv(self, new)
        prefill, stats, t_prefill = None, None, 0.0
        if new and running:
            self._count_recomputed(new)
            (seqs, first), (dseqs, tokens, stats) = self.runner.mixed(running, new)
            prefill = self.runner.last_prefill
            self._first_tokens(seqs, first, finished)
            self._postprocess(dseqs, tokens, finished)
        elif new:
            prefill = self._prefill(new, finished)
            t_prefill = time.perf_counter() - t0
        elif running:
            seqs, tokens, stats = self.runner.decode(running)
            self._postprocess(seqs, tokens, finished)
        return self._end_step(t0, tokens_before, running, stats, t_prefill, prefill, finished)

    def _end_step(self, t0: float, tokens_before: int, running: list[Sequence], stats, t_prefill: float,
                  prefill, finished: list[Request]) -> list[Request]:
        """Free what finished, record the step (--stats-json, the summary), return the finished requests."""
        self.free_kv(self.scheduler.drop_finished())
        if stats is not None and running and not (prefill is not None and prefill.mixed):
            rpart_setup.learn_step(self, stats)
        self.recorder.record(self.step_no, len(running), self.scheduler.running, self.runner, stats,
                             t_prefill, time.perf_counter() - t0, decode=bool(running),
                             tokens=self.num_output_tokens - tokens_before, prefill=prefill)
        return finished

    def _prefill(self, new: list[Sequence], finished: list[Request]):
        self._count_recomputed(new)
        self._first_tokens(*self.runner.prefill(new), finished)
        return self.runner.last_prefill

    def _count_recomputed(self, new: list[Sequence]) -> None:
        """KV recomputed for preempted sequences (those with output) in this step's prompt rows."""
        self.num_recomputed_tokens += sum((s.prefill_to or s.kv_len) - s.prefilled for s in new if s.output_ids)

    def _first_tokens(self, seqs: list[Sequence], first: np.ndarray, finished: list[Request]) -> None:
        """Sequences whose prompt ended in this step, with the token sampled from its last row."""
        self.num_prompt_tokens += sum(s.prompt_len for s in seqs)
        self._postprocess(seqs, first, finished)

    def free_kv(self, seqs: list[Sequence]) -> None:
        """Release the sequences' KV on their R-workers (sent before the next prefill or decode)."""
        if seqs:
            self.runner.forget(seqs)
            by_worker = [[] for _ in self.backend.workers]
            for s in seqs:
                by_worker[s.worker].append(s.seq_id)
            self.backend.free(by_worker)

    def _postprocess(self, seqs: list[Sequence], tokens: np.ndarray, finished: list[Request]) -> None:
        now, wall = time.perf_counter(), time.time()
        for seq, tok in zip(seqs, tokens.tolist()):
            seq.output_ids.append(tok)
            seq.token_times.append(now)
            self.num_output_tokens += 1
            metrics = seq.request.metrics
            metrics.last_token_time = wall
            if metrics.first_token_time is None:
                metrics.first_token_time = wall
            if self._check_stop(seq, tok):
                self.scheduler.finish(seq)
                self.bound_output_tokens -= seq.max_tokens - len(seq.output_ids)
                self.token_gaps.add(np.diff(seq.token_times))
                if seq.request.finished:
                    metrics.finished_time = wall
                    finished.append(seq.request)
                    self.pinned_bytes -= seq.request.pinned_bytes

    def _check_stop(self, seq: Sequence, tok: int) -> bool:
        p = seq.request.params
        n = len(seq.output_ids)
        if n >= p.min_tokens:
            if tok in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
                return True
            if not p.ignore_eos and tok in self.eos_ids:
                seq.finish_reason = "stop"
                return True
            if p.stop:
                text = self.tokenizer.decode(seq.output_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
                hits = [(text.find(s), s) for s in p.stop if s in text]
                if hits:
                    pos, stop = min(hits)
                    end = pos + len(stop) if p.include_stop_str_in_output else pos
                    seq.text, seq.finish_reason, seq.stop_reason = text[:end], "stop", stop
                    return True
        if n >= seq.max_tokens:
            seq.finish_reason = "length"
            return True
        return False

    # ------------------------------------------------------------------ outputs

    def output_of(self, req: Request) -> RequestOutput:
        """vLLM's RequestOutput of a finished request (engine/outputs.py)."""
        return request_output(req, self.tokenizer)

    def close(self) -> None:
        if self.tp is not None:
            self.parallel.close(self)
        else:
            self.backend.close()


def _note_scheduled(seqs: list[Sequence]) -> None:
    """vLLM's first_scheduled_time and time_in_queue: when a request's prompt is first taken up."""
    now = time.time()
    for seq in seqs:
        metrics = seq.request.metrics
        if metrics is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
            metrics.time_in_queue = now - metrics.arrival_time
