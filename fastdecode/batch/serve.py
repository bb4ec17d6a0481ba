"""The serving loop of one `generate` run: input lines in (a bounded look-ahead beyond what the
engine runs), requests to the engine, each finished request's row written with the record of the
request it answers; a stop request ends the loop after the step in flight (generate.py runs it)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastdecode.batch import inflight
from fastdecode.batch.group_runner import lookahead as group_lookahead
from fastdecode.batch.interrupt import StopRequest
from fastdecode.batch.jsonl import BatchLine, read_lines
from fastdecode.batch.line_server import LineServer
from fastdecode.batch.output import OutputWriter
from fastdecode.batch.progress import Progress, Snapshot, engine_snapshot
from fastdecode.batch.resume import DONE, DUP, ResumeIndex
from fastdecode.batch.schema import Limits

if TYPE_CHECKING:                 # the engine (torch) loads only when a line needs serving
    from fastdecode.batch.dealer import Dealer
    from fastdecode.engine.llm_engine import LLMEngine


class BatchRunner(LineServer):
    """Feeds input lines to the engine and writes one output row per line. With data-parallel
    groups (dealer: dealer.Dealer) it also deals lines to the other groups' engines by their
    demand and writes their rows."""

    def __init__(self, engine: LLMEngine, input_path: str, writer: OutputWriter, index: ResumeIndex,
                 stop: StopRequest | None = None, lookahead: int | None = None, limits: Limits = Limits(),
                 saved: inflight.Saved | None = None, dealer: Dealer | None = None):
        super().__init__(engine, saved)
        self.writer, self.index, self.stop, self.dealer = writer, index, stop, dealer
        if index.model is None:
            index.model = engine.served.reported
        self.lookahead = lookahead or group_lookahead(engine.args.max_batch)
        self.inflight_mem = limits.max_inflight_mem
        self.lines = read_lines(input_path, limits, engine.served)
        self.exhausted = False
        self.interrupted = False
        self.lines_read = 0                        # input lines read this run (done earlier ones included)
        self.total_lines: int | None = None        # the input's lines, when the job has counted them
        self.ended_at = time.time()
        self.engine_tokens_before = engine.num_output_tokens    # an engine lent to runs before (tests, API)
        self.reloaded_before = (engine.reload_kv.tokens, engine.reload_kv.sequences)

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _write(self, line_no: int, obj: dict, code: str | None, key: bytes) -> None:
        off, length, digest = self.writer.write(obj, key)
        self.index.record(line_no, off, length, code, digest, key)
        if self.saved is not None:
            self.saved.written(key)

    def _submit(self, line: BatchLine) -> None:
        claimed = self._claim(line)
        if claimed is not None:
            self._serve(line, *claimed)

    def _claim(self, line: BatchLine) -> tuple[bytes, list | None] | None:
        """The line as the output sees it: None if earlier rows answer it or its row is an error
        written here (a duplicate custom_id, a malformed line); else (the key its row is recorded
        under, the generation an earlier run saved for it or None)."""
        state, first, key = self.index.claim(line.line_no, line.custom_id, line.digest)
        saved = self.saved.take(key) if self.saved is not None and state != DONE else None
        if state == DONE:
            return None
        if state == DUP:     # every later line with a used custom_id is this error (resume.py relies on it)
            also = f"; the line also has this problem: {line.error}" if line.error is not None else ""
            self._error(line, key, "duplicate_custom_id",
                        f"line {line.line_no}: custom_id {line.custom_id!r} was used on line {first}{also}")
            return None
        if line.error is not None:
            self._error(line, key, line.error.code, str(line.error), line.error.status)
            return None
        return key, saved

    def _next_line(self) -> BatchLine | None:
        line = next(self.lines, None)
        if line is None:
            self.exhausted = True
        else:
            self.lines_read += 1
        return line

    def _refill(self) -> None:
        if self.dealer is not None:          # the other groups' rows in, and their asks answered first
            self.dealer.poll(self)
        sched = self.engine.scheduler
        # with other groups, at most its fair share of the work left: the input's end is shared out
        lookahead = self.lookahead
        share = self.dealer.share(self, 0) if self.dealer is not None else None
        if share is not None:
            lookahead = min(lookahead, len(sched.waiting) + share)
        while (not self.exhausted and len(sched.waiting) < lookahead and not self._stopping()
               and self.engine.pinned_bytes < self.inflight_mem):
            line = self._next_line()
            if line is not None:
                self._submit(line)

    def in_flight(self) -> dict:
        """This engine's generation in flight, and that of the other groups that stopped."""
        out = super().in_flight()
        if self.dealer is not None:
            out.update(self.dealer.in_flight)
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
        groups = self.dealer.status() if self.dealer is not None else None
        more, expected = 0.0, self.engine.expected_output_tokens() + (groups.expected_tokens if groups else 0)
        if total is not None and not self.exhausted:
            answered_before = max(index.prior_rows - index.junk - index.unbound - index.skipped, 0)
            unread = max(total - self.lines_read - answered_before, 0)
            if unread:
                more = (expected - since) / new_lines * unread if new_lines else None
        snap = engine_snapshot(self.engine, self.done_lines(), total, more, since_tokens=since,
                               engine_expected=expected)
        if groups is not None:              # the job's progress: every group's; its eta by tokens alone
            snap.tokens_done += groups.output_tokens
            snap.running += groups.running
            snap.waiting += groups.waiting
            snap.steps_done = snap.work = None
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
            idle = not eng.has_unfinished()
            if self.exhausted and idle and (self.dealer is None or self.dealer.finished):
                break                      # complete, even if a stop came during the last step
            if self._stopping():
                self.interrupted = True
                if self.dealer is not None:
                    self.dealer.stop_all(self)
                break
            if idle:
                if self.dealer is not None:            # the other groups still serve: wait for their rows
                    self.dealer.wait(self, self._stopping)
                continue
            for req in eng.step():
                self._finished(req)
            self.writer.sync()
            tick()
            if self.exhausted and not eng.has_unfinished():
                self.ended_at = time.time()     # this engine's last step (the groups' end spread)
        return self.interrupted
