"""The run report next to the output (`OUT.jsonl.summary.json`): what the file holds, what this
run did, and how the R-workers were loaded. Written when a run starts (state "running") and
again when it ends ("done" or "interrupted"); `runs` counts the runs of this output since it was
started (or --overwrite). State "failed" names the cause in `error`: an exception on rank 0, a
rank that failed or died (`failed_rank`, from its end notice: rworker/host/end_notice.py), rank 0
killed (its supervisor writes it), or the launcher ending rank 0 (what rank 0's supervisor-death
handler writes, prepared here at the start of the run: launch/supervise.py).

A stop signal is noted at once, before the step in flight ends (`stopping`, from the stop-watch
thread: batch/interrupt.py): state "interrupted", `stopping` true, the lines answered so far, so a
launcher that kills rank 0 soon after its SIGTERM (Open MPI's mpirun) leaves a report that says
so; the report written when the save completes replaces it. Whatever rank 0 writes, the note its
supervisor-death handler would write is set to the same content first, so that handler never
puts back an older state.

The state always says how the job ends: "done" is exit 0 alone; a run stopped by a signal is
"interrupted" (75); anything else that ends it is "failed" with its `exit_code` (1, or 75 where
the work is saved and a rerun goes on: a silent rank, a final rewrite that failed). A full disk
must not leave the report "running": while a run is live a spare temporary file of SPARE_BYTES
is kept allocated beside the report, and the next write goes into its blocks.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np

from fastdecode.batch.report_file import (  # noqa: F401  (write_atomic, mark_file_failed: this module's API too)
    encode,
    mark_file_failed,
    release_spare,
    reserve,
    write_atomic,
)

# The run in progress in this process (rank 0): another thread (an end notice) may fail it
# while the main thread writes it.
_live: dict = {}
_live_lock = threading.RLock()
ORPHANED = ("the launcher ended the job before rank 0 finished (it killed rank 0's supervisor, as it kills every "
            "rank once one has died: the rank that died first is named on stderr)")

HISTORY_KEEP = 100      # the last runs listed in the report (bounded, whatever the requeue count)
# each history entry's `figures`: what `fastdecode report --run N` prints of run N (report_text.py);
# scalars and short dicts only, so a hundred runs keep the report well inside its spare file
FIGURE_KEYS = ("wall_s", "steps", "decode_steps", "prompt_tokens", "output_tokens", "requests", "errors",
               "errors_by_code", "model_not_found", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
               "decode_s", "s_bubble_fraction", "r_bubble_fraction", "bound", "prefill", "prefix_hits",
               "prefix_shared_tokens", "prefix_kv_bytes_saved", "kv_tiers", "balance", "preemptions",
               "recomputed_tokens", "token_latency_p50_s", "token_latency_p99_s", "skipped_done", "retried",
               "continued_sequences", "continued_tokens", "saved_in_flight_sequences", "saved_in_flight_tokens",
               "reloaded_tokens", "reloaded_sequences", "saved_kv_sequences", "saved_kv_bytes")


def default_path(output_path: str) -> str:
    return output_path + ".summary.json"


def previous(path: str, overwrite: bool) -> dict:
    if overwrite or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            old = json.load(f)
        return old if isinstance(old, dict) else {}
    except (OSError, ValueError):
        return {}


def _commit(path: str, obj: dict) -> None:
    """Write the report of the run in progress, and make it what rank 0 writes if orphaned meanwhile."""
    from fastdecode.batch.orphan_note import note_for_orphan
    data = encode(obj)
    note_for_orphan(path, data)
    write_atomic(path, data)
    if obj.get("state") == "running" or obj.get("stopping"):
        reserve(path)                     # more writes follow: keep room for them
    else:
        release_spare(path)


def token_latency(gaps: np.ndarray) -> dict | None:
    """Seconds between a sequence's consecutive output tokens (a reservoir sample)."""
    if not gaps.size:
        return None
    p50, p90, p99 = np.percentile(gaps, [50, 90, 99])
    return {"p50_s": round(float(p50), 6), "p90_s": round(float(p90), 6), "p99_s": round(float(p99), 6),
            "mean_s": round(float(gaps.mean()), 6), "max_s": round(float(gaps.max()), 6), "samples": int(gaps.size)}


def rworker_load(workers, recorder) -> list[dict]:
    """Per R-worker: where it runs, its KV capacity, and its load over every step (stats.py)."""
    load = recorder.per_worker()
    total_attend = sum(w["attend_s"] for w in load)
    out = []
    for info, w in zip(workers, load):
        out.append({"rank": info.rank, "host": info.host, "tier": info.tier, "threads": info.threads, "isa": info.isa,
                    "kernel": info.kernel, "kv_capacity_bytes": info.capacity_bytes, **w,
                    "kv_peak_fraction": round(w["kv_bytes_peak"] / info.capacity_bytes, 6)
                    if info.capacity_bytes else None,
                    "attend_share": round(w["attend_s"] / total_attend, 4) if total_attend else None})
    return out


def run_figures(this_run: dict) -> dict:
    """The figures of a run kept in its history entry: FIGURE_KEYS of its summary, the R-workers'
    prefill appends as the slowest one's (the list grows with the R-workers)."""
    figures = {k: this_run[k] for k in FIGURE_KEYS if k in this_run}
    prefill = figures.get("prefill")
    if isinstance(prefill, dict) and prefill.get("r_append_s"):
        figures["prefill"] = dict(prefill, r_append_s=[max(prefill["r_append_s"])])
    return figures


def started(path: str, prev: dict, input_path: str, output_path: str, stats_json: str | None = None) -> dict:
    """The report of a run that has begun; written at once. `stats_json`: where this run's per-step
    statistics go (`fastdecode report` draws them from there)."""
    history = list(prev.get("history", []))[-HISTORY_KEEP:]
    report = {"state": "running", "runs": int(prev.get("runs", 0)) + 1, "interrupted": None,
              "input": os.path.abspath(input_path), "output": os.path.abspath(output_path),
              "stats_json": os.path.abspath(stats_json) if stats_json else None, "history": history}
    with _live_lock:
        _set_live(path, report)
        write_atomic(path, report)
        reserve(path)
    return report


def _set_live(path: str, report: dict | None) -> None:
    """The run in progress (None: no longer), and what rank 0 writes if the launcher ends it."""
    from fastdecode.batch.orphan_note import note_for_orphan
    _live.clear()
    if report is not None:
        _live.update(path=path, report=report, t0=time.monotonic())
        note_for_orphan(path, encode(dict(report, state="failed", interrupted=False, error=ORPHANED, exit_code=None)))
    else:
        note_for_orphan(None, None)


def track(progress_now) -> None:
    """The run in progress counts its lines and rows with progress_now() (any thread may call it):
    {"lines": {input, answered, remaining}, "requests", "errors", "skipped_done"}."""
    with _live_lock:
        if _live:
            _live["progress_now"] = progress_now


def stopping(signal_name: str | None) -> bool:
    """A stop signal came (any thread): the run in progress is written "interrupted" now, with the
    lines answered so far and a line in its history; the save that follows writes the full report.
    True if written."""
    with _live_lock:
        if not _live or _live["report"].get("state") != "running":
            return False
        report, progress_now = _live["report"], _live.get("progress_now")
        now = progress_now() if progress_now is not None else {}
        lines = now.pop("lines", None)
        run = {"run": report["runs"], "state": "interrupted", "signal": signal_name,
               "wall_s": round(time.monotonic() - _live["t0"], 4), "requests": 0, "errors": 0, "skipped_done": 0, **now}
        _commit(_live["path"], dict(report, state="interrupted", interrupted=True, signal=signal_name, exit_code=None,
                                    stopping=True, history=(report["history"] + [run])[-HISTORY_KEEP:],
                                    **({"lines": lines} if lines else {})))
    return True


def live_running() -> bool:
    """Whether a run is in progress in this process and has not ended (no lock: a signal handler asks)."""
    live = _live.get("report")
    return live is not None and live.get("state") == "running"


def failed_note(error: str, rank: int | None, exit_code: int | None = None) -> bytes | None:
    """Rank 0's supervisor-death handler, having found a rank gone: the run in progress as failed
    naming it, with the launcher's exit code where known (None: no run in progress, or it ended).
    Waits at most a second for the lock."""
    if not _live_lock.acquire(timeout=1.0):
        return None
    try:
        if not _live or _live["report"].get("state") != "running":
            return None
        return encode(dict(_live["report"], state="failed", interrupted=False, error=error, exit_code=exit_code,
                           **({"failed_rank": rank} if rank is not None else {})))
    finally:
        _live_lock.release()


def failed(path: str, report: dict, exc: BaseException, exit_code: int = 1) -> None:
    """A run that ended by an exception: its rows so far are on disk, a rerun resumes."""
    mark_failed(path, report, f"{type(exc).__name__}: {exc}", exit_code, rank=silent_rank(exc))


def silent_rank(exc: BaseException) -> int | None:
    """The rank a peer timeout names when it names one alone ("no reply from rank 1 (R-worker on
    h) within 10 s": a lost node or a partitioned link), else None."""
    from rworker.host.wait import PeerTimeout
    ranks = set(re.findall(r"\brank (\d+) \(", str(exc))) if isinstance(exc, PeerTimeout) else set()
    return int(ranks.pop()) if len(ranks) == 1 else None


def mark_failed(path: str, report: dict, error: str, exit_code: int | None, rank: int | None = None) -> bool:
    """State "failed" with its cause, unless the run already ended; True if written."""
    with _live_lock:
        if report.get("state") != "running":
            return False
        report.update(state="failed", interrupted=False, error=error, exit_code=exit_code)
        if rank is not None:
            report["failed_rank"] = rank
        if _live.get("report") is report:
            _commit(path, report)
            _set_live(path, None)
        else:
            write_atomic(path, report)
            release_spare(path)
    return True


def fail_live(error: str, rank: int | None, exit_code: int | None) -> bool:
    """Fail the run in progress in this process, if there is one (rank 0, on an end notice)."""
    with _live_lock:
        return bool(_live) and mark_failed(_live["path"], _live["report"], error, exit_code, rank)


def finished(path: str, report: dict, job, engine, this_run: dict, signal_name: str | None,
             moved: int, sort: bool) -> dict:
    """The report of a run that ended normally; engine None: it served nothing (every line was
    answered already, or a stop came before the model load). A run a dead rank failed meanwhile
    stays failed (the job ends with an error: exit_code says which)."""
    with _live_lock:
        if report.get("state") != "running":
            return report
        _finish(path, report, job, engine, this_run, signal_name, moved, sort)
        _set_live(path, None)
    return report


def exit_code_of(report: dict) -> int:
    """The exit code a job whose run report this is ends with."""
    code = report.get("exit_code")
    if isinstance(code, int):
        return code
    return 0 if report.get("state") == "done" else 75 if report.get("state") == "interrupted" else 1


def _finish(path: str, report: dict, job, engine, this_run: dict, signal_name: str | None,
            moved: int, sort: bool) -> None:
    index = job.index
    interrupted = job.interrupted
    codes = index.codes(pending_prior=interrupted)
    # an interrupted run has not matched every earlier row to a line: each line has one row at most
    answered = min(sum(codes.values()) if index.complete else job.done_lines(), job.total_lines)
    ok = min(codes.get("ok", 0), answered)
    this_run = dict(this_run, skipped_done=index.skipped, retried=index.retried, errors_by_code=dict(job.errors),
                    token_latency=token_latency(engine.token_gaps.values()) if engine is not None else None,
                    **job.inflight_summary())
    latency = this_run["token_latency"]
    exit_code = 75 if interrupted or job.rewrite_error else 0
    state = "done" if exit_code == 0 else "interrupted" if interrupted else "failed"
    report.update(
        state=state, interrupted=interrupted, signal=signal_name,
        **({"model": engine.served.reported, "served_model_names": list(engine.served.names)}
           if engine is not None else {}),
        # this run's rates (the Throughput line); earlier runs are in history
        throughput={k: this_run.get(k) for k in ("wall_s", "requests_per_s", "output_tokens_per_s",
                                                  "total_tokens_per_s")},
        token_latency={k: latency[k] for k in ("p50_s", "p90_s", "p99_s")} if latency else None,
        requests={"served_this_run": this_run["requests"], "errors_this_run": this_run["errors"],
                  "skipped_done_by_earlier_runs": index.skipped, "retried": index.retried},
        exit_code=exit_code,
        lines={"input": job.total_lines, "answered": answered, "remaining": max(job.total_lines - answered, 0),
               "ok": ok, "errors": answered - ok},
        errors_by_code={k: v for k, v in sorted(codes.items()) if k != "ok"},
        output_file={"sorted": bool(sort and exit_code == 0), "rows_moved": moved,
                     "moved_to": job.moved_to if moved else None, "moved_by_cause": dict(job.moved_by_cause),
                     "partial_line_repaired_bytes": job.writer.repaired, "rewrite_error": job.rewrite_error},
        this_run=this_run,
        rworkers=rworker_load(engine.backend.workers, engine.recorder) if engine is not None else [])
    if state == "failed":
        report["error"] = f"the final rewrite of the output failed: {job.rewrite_error}; every row is in the file, " \
                          f"in completion order: rerun the same command to rewrite it"
    else:
        report.pop("error", None)
    report["history"] = (report.pop("history") + [{
        "run": report["runs"], "state": report["state"], "signal": signal_name, "wall_s": this_run["wall_s"],
        "requests": this_run["requests"], "errors": this_run["errors"], "skipped_done": index.skipped,
        "figures": run_figures(this_run)}])[-HISTORY_KEEP:]
    _commit(path, report)
