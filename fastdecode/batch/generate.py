"""`fastdecode generate`: a JSONL batch file in, a JSONL file of completions out, resumable.

Requests are read lazily (a bounded look-ahead beyond what the engine runs), outputs appended
and flushed as requests finish. A rerun of the same command skips the input lines the output
already answers (resume.py); a stop request (interrupt.py) ends the loop after the step in
flight. Only a run that got through the whole input rewrites the file at the end: in input
order (--sort-output), or in file order less the rows that answer no line.
"""
from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from contextlib import ExitStack
from typing import TYPE_CHECKING

from fastdecode.batch import report
from fastdecode.batch.interrupt import StopRequest
from fastdecode.batch.jsonl import BatchLine, read_lines
from fastdecode.batch.line_requests import PendingLine, check_prompts, encode_prompts, request_id
from fastdecode.batch.output import OutputWriter, rewrite
from fastdecode.batch.progress import Progress, Snapshot, engine_snapshot
from fastdecode.batch.report_text import text_lines
from fastdecode.batch.responses import Answer, error_line, success_line
from fastdecode.batch.resume import DONE, DUP, ResumeIndex
from fastdecode.batch.schema import Limits, limits_from
from fastdecode.engine.request_checks import RequestError

if TYPE_CHECKING:                 # the engine (torch) loads only when a line needs serving
    from fastdecode.engine.llm_engine import LLMEngine


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class BatchRunner:
    """Feeds input lines to the engine and writes one output row per line."""

    def __init__(self, engine: LLMEngine, input_path: str, writer: OutputWriter, index: ResumeIndex,
                 stop: StopRequest | None = None, lookahead: int | None = None, limits: Limits = Limits()):
        self.engine = engine
        self.writer, self.index, self.stop = writer, index, stop
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

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _write(self, line_no: int, obj: dict, code: str | None) -> None:
        off, length = self.writer.write(obj)
        self.index.record(line_no, off, length, code)

    def _error(self, line: BatchLine, code: str, message: str, status: int = 400) -> None:
        self._write(line.line_no, error_line(line.custom_id, code, message, status), code)
        self.errors[code] += 1

    def _submit(self, line: BatchLine) -> None:
        state, first = self.index.claim(line.line_no, line.custom_id)
        if state == DONE:
            return
        if state == DUP:     # every later line with a used custom_id is this error (resume.py relies on it)
            also = f"; the line also has this problem: {line.error}" if line.error is not None else ""
            self._error(line, "duplicate_custom_id",
                        f"line {line.line_no}: custom_id {line.custom_id!r} was used on line {first}{also}")
            return
        if line.error is not None:
            self._error(line, line.error.code, str(line.error), line.error.status)
            return
        try:
            prompts = encode_prompts(self.engine.tokenizer, line)
        except Exception as e:  # a chat template may raise on odd role orders, etc.
            self._error(line, "invalid_prompt", f"cannot tokenize: {type(e).__name__}: {e}")
            return
        try:
            if len(prompts) > 1:            # all of a line or none: checked before any is queued
                check_prompts(self.engine, prompts, line.params)
            reqs = [self.engine.add_request(self._next_index + k, request_id(line, k, len(prompts)), text, ids,
                                            line.params) for k, (text, ids) in enumerate(prompts)]
        except RequestError as e:
            self._error(line, e.code, str(e))
            return
        self._next_index += len(reqs)
        pending = PendingLine(line, [None] * len(reqs))
        for k, req in enumerate(reqs):
            self.pending[req.index] = (pending, k)

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
        self._write(line.line_no, row, None)
        self.num_requests += 1

    def done_lines(self) -> int:
        return self.index.skipped + self.num_requests + self.num_errors

    def snapshot(self) -> Snapshot:
        """Progress of this run. Lines not read yet are expected to need as many tokens as the
        lines read so far that earlier runs had not answered, on average; the earlier runs'
        rows not met yet are taken to answer as many of the unread lines."""
        index, total = self.index, self.total_lines
        new_lines = self.lines_read - index.skipped
        more, expected = 0.0, self.engine.expected_output_tokens()
        if total is not None and not self.exhausted:
            answered_before = max(index.prior_rows - index.junk - index.skipped, 0)
            unread = max(total - self.lines_read - answered_before, 0)
            if unread:
                more = expected / new_lines * unread if new_lines else None
        return engine_snapshot(self.engine, self.done_lines(), total, more, engine_expected=expected)

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


def finalize_output(writer: OutputWriter, index: ResumeIndex, sort: bool) -> int:
    """After a complete run: rewrite the file if it has rows that answer no input line, or (sort)
    is out of input order. Returns the rows dropped."""
    writer.close()
    dropped = index.dropped()
    if dropped or (sort and not index.in_input_order()):
        rewrite(writer.path, index.ranges(sort))
    return dropped


def print_report(summary: dict, rep: dict | None, rows_on_stdout: bool = False) -> None:
    """The run in a few lines on stderr (report_text.py), then the Throughput line on stdout, last
    (on stderr too where stdout holds the rows: -o -)."""
    from fastdecode.launch.streams import drain_stderr
    *lines, throughput = text_lines(summary, rep)
    for line in lines:
        print(f"fastdecode: {line}", file=sys.stderr, flush=True)
    if not rows_on_stdout:
        drain_stderr()                   # a launcher forwards stderr and stdout apart: stderr first
    print(throughput, file=sys.stderr if rows_on_stdout else sys.stdout, flush=True)


def run_summary(runner: BatchRunner, wall: float) -> dict:
    """This run's numbers (the --stats-json summary, and `this_run` in the report)."""
    eng = runner.engine
    out = eng.recorder.summary(wall, eng.num_output_tokens, eng.num_prompt_tokens, eng.token_gaps.values())
    out.update(model=eng.served.reported, served_model_names=list(eng.served.names),
               model_not_found=runner.errors.get("model_not_found", 0),
               requests=runner.num_requests, errors=runner.num_errors,
               requests_per_s=round(runner.num_requests / wall, 4) if wall else None,
               preemptions=eng.scheduler.num_preemptions, recomputed_tokens=eng.num_recomputed_tokens,
               kv_dtype=eng.kv_dtype, kv_bytes_per_token=eng.kv_bytes_per_token, **eng.prefix_summary())
    return out


class BatchJob:
    """One run of `generate`: open (resume), run, close the engine, finish (rewrite, report)."""

    def __init__(self, input_path: str, output_path: str, overwrite: bool = False, index_dir: str | None = None,
                 stop: StopRequest | None = None, limits: Limits = Limits()):
        self.input_path, self.output_path = input_path, output_path
        self.limits, self.index_dir = limits, index_dir
        self.stop = stop
        self.writer = OutputWriter(output_path, overwrite=overwrite)
        self.index = self._load_index()
        self.total_lines = count_lines(input_path)      # streamed; for the progress total and messages
        if self.index.prior_rows:
            rows = self.index.prior_rows - self.index.junk
            print(f"fastdecode: resuming: {rows} of {self.total_lines} requests already in {output_path}",
                  file=sys.stderr, flush=True)
        self.runner: BatchRunner | None = None
        # earlier rows that answer a line for good (counted once: progress_now, for the stop-watch thread)
        self.prior_done = self.index.done_prior() if self.index.complete and self.index.prior_rows else 0
        self.wall = 0.0
        self.rewrite_error: str | None = None
        self.completed = False        # every input line is answered (this run's rows and earlier ones)

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _load_index(self) -> ResumeIndex:
        index = ResumeIndex(self.index_dir)
        try:      # a stop during a long scan leaves the index incomplete: run() then serves nothing
            index.load(self.output_path, self.writer.start_size, stop=self._stopping)
        except BaseException:
            index.close()
            self.writer.close()
            raise
        return index

    def every_line_answered(self) -> bool:
        """Whether earlier runs answered every input line, found before any engine exists. Only when
        the earlier rows could (one done row per line at least) are the lines read and matched, as
        a run would; if one needs serving, the index is loaded afresh for the run."""
        index = self.index
        if not index.complete or not index.prior_rows or self.prior_done < self.total_lines:
            return False
        for i, line in enumerate(read_lines(self.input_path, self.limits)):
            if i % 10_000 == 0 and self._stopping():
                return False              # no run follows: the index counts the lines done as it is
            if index.claim(line.line_no, line.custom_id)[0] != DONE:
                index.close()
                self.index = self._load_index()
                return False
        self.completed = True
        return True

    @property
    def interrupted(self) -> bool:
        """Stopped with input lines left: during the run, or before an engine was made."""
        return self.runner.interrupted if self.runner is not None else self._stopping() and not self.completed

    @property
    def errors(self) -> Counter[str]:
        """Error rows this run wrote, by code."""
        return self.runner.errors if self.runner is not None else Counter()

    def run(self, engine: LLMEngine, show_progress: bool = True, progress_interval: float | None = None) -> bool:
        total = self.total_lines
        self.runner = BatchRunner(engine, self.input_path, self.writer, self.index, self.stop, limits=self.limits)
        self.runner.total_lines = total
        start = time.perf_counter()
        with Progress(self.runner.snapshot, enabled=show_progress, interval=progress_interval) as progress:
            interrupted = self.runner.run(progress)
            progress.finish("interrupted" if interrupted else "done")
        self.wall = time.perf_counter() - start
        self.writer.close()
        self.completed = not interrupted
        if interrupted:
            report.stopping(self.stop.name)     # the rows of the step in flight too, before the shutdown
            print(f"fastdecode: interrupted by {self.stop.name}: {self.done_lines()} of {total} requests done; "
                  f"rerun the same command to resume", file=sys.stderr, flush=True)
        return interrupted

    def progress_now(self) -> dict:
        """Input lines answered so far and this run's rows, from counters that any thread may read
        (the stop-watch thread's note: report.stopping); no lines while earlier rows are unread."""
        index, runner = self.index, self.runner
        out = {"requests": runner.num_requests if runner else 0, "errors": runner.num_errors if runner else 0,
               "skipped_done": index.skipped}
        if index.complete:
            answered = self.prior_done + index.rows_total - index.prior_rows
            out["lines"] = {"input": self.total_lines, "answered": answered,
                            "remaining": max(self.total_lines - answered, 0)}
        return out

    def done_lines(self) -> int:
        """Input lines answered in the output now: this run's rows, the earlier rows it matched,
        and the earlier done rows of lines it did not reach (an interrupted run). A stop during
        the resume scan leaves earlier rows unread: they are counted as rows of the file."""
        if not self.index.complete:
            return count_lines(self.writer.path)
        return sum(self.index.codes(pending_prior=True).values())

    def finish(self, sort: bool) -> int:
        """After the engine is closed: the final rewrite of a complete run; rows dropped."""
        if not self.completed:
            return 0
        try:
            dropped = finalize_output(self.writer, self.index, sort)
        except OSError as e:              # a full disk: the output is as it was, every row in it
            self.rewrite_error = f"{type(e).__name__}: {e}"
            print(f"fastdecode: {self.output_path}: the final rewrite failed ({e}); the file holds every row "
                  f"in completion order; rerun the same command to rewrite it", file=sys.stderr, flush=True)
            return 0
        if dropped:
            print(f"fastdecode: {self.output_path}: dropped {dropped} line(s) that answer no input line "
                  f"({self.index.superseded + self.index.retried} superseded by a retry, "
                  f"{self.index.junk} not output rows)", file=sys.stderr, flush=True)
        return dropped

    def close(self) -> None:
        self.writer.close()
        self.index.close()

    def __enter__(self) -> BatchJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def idle_summary(wall: float) -> dict:
    """This run's numbers when it served nothing and made no engine."""
    return {"wall_s": round(wall, 4), "steps": 0, "output_tokens": 0, "prompt_tokens": 0, "requests": 0,
            "errors": 0, "requests_per_s": None, "output_tokens_per_s": None, "total_tokens_per_s": None}


def run_generate(make_engine, args, stop: StopRequest, skip_engine=lambda: None) -> tuple[dict | None, dict, bool]:
    """Resume, serve, shut the engine down, rewrite, report; (this run's summary, the run report, interrupted).

    The engine (and with it the R-workers' start-up and kernel tune) is made only once the output
    was read and some input line needs serving; otherwise skip_engine() ends the R-workers and the
    summary is None: earlier runs answered every line, or a stop came first. The engine is closed
    on every path, and before the final rewrite (which may take a while)."""
    path = args.summary_json or report.default_path(args.output)
    engine = None
    closed = []
    start = time.perf_counter()

    def close_engine() -> None:          # once: a second SHUTDOWN would reach R-workers that are gone
        if engine is not None and not closed:
            closed.append(True)
            engine.close()

    with ExitStack() as stack:
        job = stack.enter_context(BatchJob(args.input, args.output, overwrite=args.overwrite,
                                           index_dir=args.index_dir, stop=stop, limits=limits_from(args)))
        stack.callback(close_engine)
        rep = report.started(path, report.previous(path, args.overwrite), args.input, args.output,
                             stats_json=args.stats_json)
        report.track(job.progress_now)
        stop.watch(lambda signum: report.stopping(signal.Signals(signum).name))   # noted at once, any thread
        try:
            if stop.requested or job.every_line_answered() or stop.requested:
                skip_engine()
                rep = finish_without_engine(job, path, rep, args, stop, time.perf_counter() - start)
                return None, rep, job.interrupted or job.rewrite_error is not None
            engine = make_engine()
            print(f"fastdecode: {engine.served.describe()}", file=sys.stderr, flush=True)
            print(f"fastdecode: {engine.describe_model()}", file=sys.stderr, flush=True)
            interrupted = job.run(engine, show_progress=not args.quiet,
                                  progress_interval=getattr(args, "progress_interval", None))
        except BaseException as e:
            from rworker.host.wait import PeerTimeout
            report.failed(path, rep, e, exit_code=75 if isinstance(e, PeerTimeout) else 1)   # as mpi_env.fail
            raise
        close_engine()
        dropped = job.finish(sort=args.sort_output)
        summary = run_summary(job.runner, job.wall)
        rep = report.finished(path, rep, job, engine, summary, stop.name, dropped, args.sort_output)
    return summary, rep, interrupted or job.rewrite_error is not None


def finish_without_engine(job: BatchJob, path: str, rep: dict, args, stop: StopRequest, wall: float) -> dict:
    """A run that made no engine: every line was answered (rewrite if needed, report) or a stop came
    before the model load."""
    if job.interrupted:
        print(f"fastdecode: interrupted by {stop.name} before the model was loaded: {job.done_lines()} of "
              f"{job.total_lines} requests done; rerun the same command to resume", file=sys.stderr, flush=True)
        dropped = 0
    else:
        dropped = job.finish(sort=args.sort_output)
        print(f"fastdecode: every line of {args.input} is already answered in {args.output} "
              f"({job.total_lines} lines); nothing to do (--overwrite starts over)", file=sys.stderr, flush=True)
    return report.finished(path, rep, job, None, idle_summary(wall), stop.name, dropped, args.sort_output)
