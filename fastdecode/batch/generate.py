"""`fastdecode generate`: a JSONL batch file in, a JSONL file of completions out, resumable.

Requests are read lazily (a bounded look-ahead beyond what the engine runs), outputs appended
and flushed as requests finish, each with the record of the request it answers (binding.py). A
rerun of the same command skips the input lines the output already answers (resume.py); a stop
request (interrupt.py) ends the loop after the step in flight and saves the generation in flight
(inflight.py), which the rerun continues. Only a run that got through the whole input rewrites
the file at the end: in input order (--sort-output), or in file order, less the rows that answer
no line, which go to OUTPUT.unmatched.jsonl.
"""
from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from contextlib import ExitStack
from typing import TYPE_CHECKING

from fastdecode.batch import binding, inflight, kv_stop, report
from fastdecode.batch.interrupt import StopRequest
from fastdecode.batch.jsonl import count_lines, read_lines
from fastdecode.batch.output import OutputWriter, append_rows, rewrite
from fastdecode.batch.progress import Progress
from fastdecode.batch.report_text import text_lines
from fastdecode.batch.resume import DONE, MOVED_CAUSES, ResumeIndex
from fastdecode.batch.schema import Limits, limits_from
from fastdecode.batch.serve import BatchRunner
from fastdecode.batch.sidefiles import inflight_path, real, unmatched_path
from fastdecode.batch.stdio import input_identity

if TYPE_CHECKING:                 # the engine (torch) loads only when a line needs serving
    from fastdecode.engine.llm_engine import LLMEngine


def finalize_output(writer: OutputWriter, index: ResumeIndex, sort: bool) -> Counter[str]:
    """After a complete run: rewrite the file if it has rows that answer no input line (moved to
    OUTPUT.unmatched.jsonl first) or (sort) is out of input order. -> the rows moved, by cause."""
    writer.close()
    moved: Counter[str] = Counter()
    if not index.unanswering() and not (sort and not index.in_input_order()):
        return moved

    def moved_rows():
        for off, length, cause in index.moved():
            moved[cause] += 1
            yield off, length
    if index.unanswering():
        append_rows(writer.path, moved_rows(), unmatched_path(writer.path))
    rewrite(writer.path, index.ranges(sort))
    binding.compact(writer.path, index.kept_records())
    return moved


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
               reloaded_tokens=eng.reload_kv.tokens - runner.reloaded_before[0],
               reloaded_sequences=eng.reload_kv.sequences - runner.reloaded_before[1],
               kv_dtype=eng.kv_dtype, kv_bytes_per_token=eng.kv_bytes_per_token, **eng.prefix_summary(),
               **eng.tier_summary())
    if runner.dealer is not None:
        add_groups(out, runner.dealer.summaries(), wall, runner.ended_at)
    return out


def add_groups(out: dict, groups: list[dict], wall: float, ended_at: float) -> None:
    """The job's tokens are every group's: group 0's figures (out) become the first of
    `data_parallel_groups`, the totals and rates the job's; `group_end_spread_s`: how long after the
    first group to run out of work the last one did (ended_at: group 0's end, time.time())."""
    first = {"group": 0, "requests": out["requests"] - sum(g.get("requests", 0) for g in groups),
             "errors": out["errors"] - sum(g.get("errors", 0) for g in groups), "output_tokens": out["output_tokens"],
             "prompt_tokens": out["prompt_tokens"], "steps": out["steps"], "wall_s": out["wall_s"], "ended_at": ended_at}
    out["data_parallel_groups"] = [first, *groups]
    ends = [g["ended_at"] for g in out["data_parallel_groups"] if g.get("ended_at")]
    out["group_end_spread_s"] = round(max(ends) - min(ends), 4) if ends else None
    for key in ("output_tokens", "prompt_tokens"):
        out[key] += sum(g.get(key, 0) for g in groups)
    if wall:
        out["output_tokens_per_s"] = round(out["output_tokens"] / wall, 3)
        out["total_tokens_per_s"] = round((out["output_tokens"] + out["prompt_tokens"]) / wall, 3)


class BatchJob:
    """One run of `generate`: open (resume), run, close the engine, finish (rewrite, report)."""

    def __init__(self, input_path: str, output_path: str, overwrite: bool = False, index_dir: str | None = None,
                 stop: StopRequest | None = None, limits: Limits = Limits(), model: str | None = None,
                 model_identity: dict | None = None, save_kv: str = "auto"):
        """model: the served model's name (the engine's, when it is made: then only a run can
        find every line answered); model_identity: what the rows and the in-flight save are bound
        to (binding.job_model), a rerun with another model refused."""
        self.input_path, self.output_path = input_path, output_path
        self.limits, self.index_dir, self.model = limits, index_dir, model
        self.model_identity = model_identity
        self.stop, self.save_kv = stop, save_kv       # save_kv: --save-kv-on-stop (kv_stop.py)
        self.writer = OutputWriter(output_path, input_path, overwrite=overwrite, model=model_identity)
        self.inflight_path = inflight_path(output_path)
        if overwrite:
            inflight.discard_save(self.inflight_path)
        self.index = self._load_index()
        self.total_lines = count_lines(input_path)      # streamed; for the progress total and messages
        if self.index.prior_rows:
            print(f"fastdecode: resuming: {output_path} holds {self.index.prior_rows} row(s) of earlier runs; "
                  f"the lines of {input_path} ({self.total_lines}) whose requests they answer are skipped",
                  file=sys.stderr, flush=True)
        self.runner: BatchRunner | None = None
        self.saved: inflight.Saved | None = None
        self.saved_seqs = self.saved_tokens = 0          # what this run's stop saved in flight
        self.saved_kv_seqs = self.saved_kv_bytes = 0     # and of their KV
        self.moved_by_cause: Counter[str] = Counter()
        self.moved_to = unmatched_path(output_path)
        # earlier rows that answer a line for good (counted once: progress_now, for the stop-watch thread)
        self.prior_done = self.index.done_prior() if self.index.complete and self.index.prior_rows else 0
        self.wall = 0.0
        self.rewrite_error: str | None = None
        self.completed = False        # every input line is answered (this run's rows and earlier ones)

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _load_index(self) -> ResumeIndex:
        index = ResumeIndex(self.index_dir, self.model)
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
        if index.model is None or not index.complete or not index.prior_rows or self.prior_done < self.total_lines:
            return False
        for i, line in enumerate(read_lines(self.input_path, self.limits)):
            if i % 10_000 == 0 and self._stopping():
                return False              # no run follows: the index counts the lines done as it is
            if index.claim(line.line_no, line.custom_id, line.digest).state != DONE:
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

    def identity(self, engine: LLMEngine) -> dict:
        """What an in-flight save is for: this output, this input, this model (its name and, where
        known, its content's digest)."""
        out = {"output": real(self.output_path), "input": input_identity(self.input_path),
               "model": engine.served.reported}
        if self.model_identity is not None:
            out["model_digest"] = self.model_identity["digest"]
        return out

    def run(self, engine: LLMEngine, show_progress: bool = True, progress_interval: float | None = None,
            dealer=None) -> bool:
        """dealer: the other data-parallel groups' (batch/dealer.py), if any."""
        total = self.total_lines
        self.saved = inflight.Saved(self.inflight_path, self.identity(engine))
        self.runner = BatchRunner(engine, self.input_path, self.writer, self.index, self.stop, limits=self.limits,
                                  saved=self.saved, dealer=dealer)
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
            self.save_in_flight(engine)
            print(f"fastdecode: interrupted by {self.stop.name}: {self.done_lines()} of {total} requests done; "
                  f"rerun the same command to resume", file=sys.stderr, flush=True)
        return interrupted

    def save_in_flight(self, engine: LLMEngine) -> None:
        """A stop: the generation of the lines in flight (and a save's lines not reached) to
        OUTPUT.inflight, for the rerun to continue. A failed save loses no row: they start over."""
        entries = {**self.saved.carried(), **self.runner.in_flight()}
        try:
            self.saved_seqs, self.saved_tokens = inflight.save(self.inflight_path, self.writer.path,
                                                               self.identity(engine), entries)
        except OSError as e:
            print(f"fastdecode: {self.inflight_path}: could not save the sequences in flight ({e}); they start over "
                  f"in the rerun", file=sys.stderr, flush=True)
            inflight.discard_save(self.inflight_path)
            return
        if self.saved_seqs:
            print(f"fastdecode: saved {self.saved_seqs} sequence(s) in flight ({self.saved_tokens} generated tokens) "
                  f"to {self.inflight_path}; the rerun continues them", file=sys.stderr, flush=True)
        self.saved_kv_seqs, self.saved_kv_bytes = kv_stop.save(self, engine, self.save_kv)

    def inflight_summary(self) -> dict:
        """This run's continued and saved generation (the report's this_run)."""
        saved = self.saved
        return {"continued_sequences": saved.continued_seqs if saved else 0,
                "continued_tokens": saved.continued_tokens if saved else 0,
                "saved_in_flight_sequences": self.saved_seqs, "saved_in_flight_tokens": self.saved_tokens,
                "saved_kv_sequences": self.saved_kv_seqs, "saved_kv_bytes": self.saved_kv_bytes}

    def progress_now(self) -> dict:
        """Input lines answered so far and this run's rows, from counters that any thread may read
        (the stop-watch thread's note: report.stopping); no lines while earlier rows are unread."""
        index, runner = self.index, self.runner
        out = {"requests": runner.num_requests if runner else 0, "errors": runner.num_errors if runner else 0,
               "skipped_done": index.skipped}
        if index.complete:
            answered = min(self.prior_done + index.rows_total - index.prior_rows, self.total_lines)
            out["lines"] = {"input": self.total_lines, "answered": answered,
                            "remaining": max(self.total_lines - answered, 0)}
        return out

    def done_lines(self) -> int:
        """Input lines answered in the output now: this run's rows, the earlier rows it matched,
        and the earlier done rows of lines it did not reach (an interrupted run). A stop during
        the resume scan leaves earlier rows unread: they are counted as rows of the file."""
        if not self.index.complete:
            return min(count_lines(self.writer.path), self.total_lines)
        return min(sum(self.index.codes(pending_prior=True).values()), self.total_lines)

    def finish(self, sort: bool) -> int:
        """After the engine is closed: the final rewrite of a complete run; -> the rows moved out."""
        if not self.completed:
            return 0
        inflight.discard_save(self.inflight_path)      # every line is answered: nothing is in flight
        try:
            self.moved_by_cause = finalize_output(self.writer, self.index, sort)
        except OSError as e:              # a full disk: the output is as it was, every row in it
            self.rewrite_error = f"{type(e).__name__}: {e}"
            print(f"fastdecode: {self.output_path}: the final rewrite failed ({e}); the file holds every row "
                  f"in completion order; rerun the same command to rewrite it", file=sys.stderr, flush=True)
            return 0
        moved = sum(self.moved_by_cause.values())
        if moved:
            causes = {"superseded": "superseded by a retry", "unmatched": "answer a request not in the input",
                      "unbound": "without a record of their request", "junk": "not output rows"}
            parts = ", ".join(f"{self.moved_by_cause[c]} {causes[c]}" for c in MOVED_CAUSES if self.moved_by_cause[c])
            print(f"fastdecode: {self.output_path}: moved {moved} row(s) that answer no input line to "
                  f"{self.moved_to} ({parts})", file=sys.stderr, flush=True)
        return moved

    def close(self) -> None:
        self.writer.close()
        self.index.close()

    def __enter__(self) -> BatchJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def idle_summary(wall: float) -> dict:
    """This run's numbers when it served nothing and made no engine."""
    return {"wall_s": round(wall, 4), "steps": 0, "decode_steps": 0, "output_tokens": 0, "prompt_tokens": 0, "requests": 0,
            "errors": 0, "requests_per_s": None, "output_tokens_per_s": None, "total_tokens_per_s": None}


def served_name(args) -> str:
    """The name the job's rows give the model (the engine's ServedModel.reported), from the flags alone."""
    from fastdecode.model.names import served_model
    from fastdecode.model.source import resolve_model
    return served_model(resolve_model(args.model), args.served_model_name).reported


def run_generate(make_engine, args, stop: StopRequest, skip_engine=lambda: None,
                 dealer=None) -> tuple[dict | None, dict, int]:
    """Resume, serve, shut the engine down, rewrite, report; (this run's summary, the run report,
    the exit code: the report's).

    The engine (and with it the R-workers' start-up and kernel tune) is made only once the output
    was read and some input line needs serving; otherwise skip_engine() ends the R-workers and the
    summary is None: earlier runs answered every line, or a stop came first. The engine is closed
    on every path, and before the final rewrite (which may take a while). dealer: the other
    data-parallel groups (batch/dealer.py), told to start or skip as this engine is."""
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
                                           index_dir=args.index_dir, stop=stop, limits=limits_from(args),
                                           model=served_name(args), model_identity=binding.job_model(args),
                                           save_kv=args.save_kv_on_stop))
        stack.callback(close_engine)
        rep = report.started(path, report.previous(path, args.overwrite), args.input, args.output,
                             stats_json=args.stats_json)
        report.track(job.progress_now)
        stop.watch(lambda signum: report.stopping(signal.Signals(signum).name))   # noted at once, any thread
        try:
            if stop.requested or job.every_line_answered() or stop.requested:
                skip_engine()
                rep = finish_without_engine(job, path, rep, args, stop, time.perf_counter() - start)
                return None, rep, report.exit_code_of(rep)
            engine = make_engine()
            print(f"fastdecode: {engine.served.describe()}", file=sys.stderr, flush=True)
            print(f"fastdecode: {engine.describe_model()}", file=sys.stderr, flush=True)
            job.run(engine, show_progress=not args.quiet, progress_interval=getattr(args, "progress_interval", None),
                    dealer=dealer)
            close_engine()
            moved = job.finish(sort=args.sort_output)
            summary = run_summary(job.runner, job.wall)
            if args.stats_json:               # before the report: a failure here fails the run
                from fastdecode.batch.report_file import write_stats
                write_stats(args.stats_json, engine.recorder.document(summary))
            rep = report.finished(path, rep, job, engine, summary, stop.name, moved, args.sort_output)
        except BaseException as e:
            from rworker.host.wait import PeerTimeout
            report.failed(path, rep, e, exit_code=75 if isinstance(e, PeerTimeout) else 1)   # as mpi_env.fail
            raise
    return summary, rep, report.exit_code_of(rep)


def finish_without_engine(job: BatchJob, path: str, rep: dict, args, stop: StopRequest, wall: float) -> dict:
    """A run that made no engine: every line was answered (rewrite if needed, report) or a stop came
    before the model load."""
    if job.interrupted:
        print(f"fastdecode: interrupted by {stop.name} before the model was loaded: {job.done_lines()} of "
              f"{job.total_lines} requests done; rerun the same command to resume", file=sys.stderr, flush=True)
        moved = 0
    else:
        moved = job.finish(sort=args.sort_output)
        print(f"fastdecode: every line of {args.input} is already answered in {args.output} "
              f"({job.total_lines} lines); nothing to do (--overwrite starts over)", file=sys.stderr, flush=True)
    return report.finished(path, rep, job, None, idle_summary(wall), stop.name, moved, args.sort_output)
