"""The serving loop of one `generate` run: input lines in (a bounded look-ahead beyond what the
engine runs), requests to the engine, each finished request's row written with the record of the
request it answers; a stop request ends the loop after the step in flight (generate.py runs it)."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from fastdecode.batch import inflight
from fastdecode.batch.interrupt import StopRequest
from fastdecode.batch.jsonl import BatchLine, read_lines
from fastdecode.batch.line_requests import PendingLine, check_prompts, encode_prompts, request_id
from fastdecode.batch.output import OutputWriter
from fastdecode.batch.progress import Progress, Snapshot, engine_snapshot
from fastdecode.batch.responses import Answer, error_line, success_line
from fastdecode.batch.resume import DONE, DUP, ResumeIndex
from fastdecode.batch.schema import Limits
from fastdecode.engine.continuation import capture
from fastdecode.engine.request_checks import RequestError

if TYPE_CHECKING:                 # the engine (torch) loads only when a line needs serving
    from fastdecode.engine.llm_engine import LLMEngine


class BatchRunner:
    """Feeds input lines to the engine and writes one output row per line."""

    def __init__(self, engine: LLMEngine, input_path: str, writer: OutputWriter, index: ResumeIndex,
                 stop: StopRequest | None = None, lookahead: int | None = None, limits: Limits = Limits(),
                 saved: inflight.Saved | None = None):
        self.engine = engine
        self.writer, self.index, self.stop, self.saved = writer, index, stop, saved
        if index.model is None:
            index.model = engine.served.reported
        self.lookahead = lookahead or max(2 * engine.args.max_batch, 64)
        self.inflight_mem = limits.max_inflight_mem
        self.lines = read_lines(input_path, limits, engine.served)
        self.exhausted = False
        self.interrupted = False
        self.pending: dict[int, tuple[PendingLine, int]] = {}    # request index -> its line, which prompt
        self._next_index = 0
        self.lines_read = 0                        # input lines read this run (done earlier ones included)
        self.total_lines: int | None = None        # the input's lines, when the job has counted them
        self.num_requests = 0                      # served this run
        self.errors: Counter[str] = Counter()      # error rows this run, by code
        self.engine_tokens_before = engine.num_output_tokens    # an engine lent to runs before (tests, API)
        self.reloaded_before = (engine.reload_kv.tokens, engine.reload_kv.sequences)

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _write(self, line_no: int, obj: dict, code: str | None, key: bytes) -> None:
        off, length, digest = self.writer.write(obj, key)
        self.index.record(line_no, off, length, code, digest, key)
        if self.saved is not None:
            self.saved.written(key)

    def _error(self, line: BatchLine, key: bytes, code: str, message: str, status: int = 400) -> None:
        self._write(line.line_no, error_line(line.custom_id, code, message, status), code, key)
        self.errors[code] += 1

    def _submit(self, line: BatchLine) -> None:
        state, first, key = self.index.claim(line.line_no, line.custom_id, line.digest)
        saved = self.saved.take(key) if self.saved is not None and state != DONE else None
        if state == DONE:
            return
        if state == DUP:     # every later line with a used custom_id is this error (resume.py relies on it)
            also = f"; the line also has this problem: {line.error}" if line.error is not None else ""
            self._error(line, key, "duplicate_custom_id",
                        f"line {line.line_no}: custom_id {line.custom_id!r} was used on line {first}{also}")
            return
        if line.error is not None:
            self._error(line, key, line.error.code, str(line.error), line.error.status)
            return
        try:
            prompts = encode_prompts(self.engine.tokenizer, line)
        except Exception as e:  # a chat template may raise on odd role orders, etc.
            self._error(line, key, "invalid_prompt", f"cannot tokenize: {type(e).__name__}: {e}")
            return
        if saved is not None and len(saved) != len(prompts):
            self.saved.note_used(saved, [f"{len(saved)} prompts saved, the line has {len(prompts)}"] * len(saved),
                                 line.line_no)
            saved = None
        try:
            if len(prompts) > 1:            # all of a line or none: checked before any is queued
                check_prompts(self.engine, prompts, line.params)
            reqs = [self.engine.add_request(self._next_index + k, request_id(line, k, len(prompts)), text, ids,
                                            line.params, resume=saved[k] if saved is not None else None)
                    for k, (text, ids) in enumerate(prompts)]
        except RequestError as e:
            self._error(line, key, e.code, str(e))
            return
        self._next_index += len(reqs)
        pending = PendingLine(line, [None] * len(reqs), key, reqs)
        for k, req in enumerate(reqs):
            self.pending[req.index] = (pending, k)
        if saved is not None:
            self.saved.note_used(saved, [r.meta.get("resume_refused") for r in reqs], line.line_no)
        for req in reqs:
            if req.finished:                # every sample had finished before the stop
                self._finished(req)

    def _refill(self) -> None:
        sched = self.engine.scheduler
        while (not self.exhausted and len(sched.waiting) < self.lookahead and not self._stopping()
               and self.engine.pinned_bytes < self.inflight_mem):
            line = next(self.lines, None)
            if line is None:
                self.exhausted = True
            else:
                self.lines_read += 1
                self._submit(line)

    def _answer(self, line: BatchLine, req) -> Answer:
        """One finished request (one prompt of a line) as its part of the line's row."""
        tok = self.engine.tokenizer
        echo = None
        if line.echo:
            echo = req.prompt if req.prompt is not None else tok.decode(req.prompt_ids, False)
        return Answer(self.engine.output_of(req), len(req.prompt_ids), echo, tok.token_text(req.prompt_ids[0]))

    def _finished(self, req) -> None:
        """A request is done: its line's row is written once all of the line's prompts are."""
        pending, k = self.pending.pop(req.index)
        pending.answers[k] = self._answer(pending.line, req)
        if any(a is None for a in pending.answers):
            return
        line = pending.line
        row = success_line(line.custom_id, line.is_chat, self.engine.served.reported, pending.answers,
                           line.params.logprobs or 0, line.echo_only)
        self._write(line.line_no, row, None, pending.key)
        self.num_requests += 1

    def in_flight(self) -> dict[bytes, inflight.Entry]:
        """Every line whose row is not written: its requests' generation so far (those with any)."""
        out: dict[bytes, inflight.Entry] = {}
        for pending in {id(p): p for p, _ in self.pending.values()}.values():
            states = [capture(req) for req in pending.requests]
            if any(st is not None for st in states):
                out[pending.key] = (pending.line.custom_id, states)
        return out

    def done_lines(self) -> int:
        return self.index.skipped + self.num_requests + self.num_errors

    def snapshot(self) -> Snapshot:
        """Progress of the job: its tokens, done and expected, with those of earlier runs (their
        rows, and the saved tokens this run continues) in both. Lines not read yet are expected
        to need as many tokens as the lines read so far that earlier runs had not answered, on
        average; the earlier runs' rows not met yet are taken to answer as many of the unread lines."""
        index, total = self.index, self.total_lines
        new_lines = self.lines_read - index.skipped
        since = self.engine_tokens_before
        more, expected = 0.0, self.engine.expected_output_tokens()
        if total is not None and not self.exhausted:
            answered_before = max(index.prior_rows - index.junk - index.unbound - index.skipped, 0)
            unread = max(total - self.lines_read - answered_before, 0)
            if unread:
                more = (expected - since) / new_lines * unread if new_lines else None
        snap = engine_snapshot(self.engine, self.done_lines(), total, more, since_tokens=since,
                               engine_expected=expected)
        continued = self.saved.continued_tokens if self.saved is not None else 0
        snap.tokens_before = index.prior_tokens + continued
        snap.tokens_done += snap.tokens_before
        if snap.tokens_expected is not None:          # the engine's expects continued sequences whole
            snap.tokens_expected += index.prior_tokens
        return snap

    def run(self, progress: Progress) -> bool:
        """Serve until the input is done or a stop is requested; True if stopped early."""
        eng = self.engine
        tick = progress.update
        while True:
            if not self._stopping():
                self._refill()
            tick()
            if self.exhausted and not eng.has_unfinished():
                break                      # complete, even if a stop came during the last step
            if self._stopping():
                self.interrupted = True
                break
            if not eng.has_unfinished():
                continue
            for req in eng.step():
                self._finished(req)
            self.writer.sync()
            tick()
        return self.interrupted
