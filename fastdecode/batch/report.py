"""The run report next to the output (`OUT.jsonl.summary.json`): what the file holds, what this
run did, and how the R-workers were loaded. Written when a run starts (state "running") and
again when it ends ("done" or "interrupted"); `runs` counts the runs of this output since it was
started (or --overwrite). State "failed" names the cause in `error`: an exception on rank 0, a
rank that failed or died (`failed_rank`, from its end notice: rworker/host/end_notice.py), rank 0
killed (its supervisor writes it), or the launcher ending rank 0 (what rank 0's supervisor-death
handler writes, prepared here at the start of the run: launch/supervise.py)."""
from __future__ import annotations

import json
import os
import threading

import numpy as np

# The run in progress in this process (rank 0): another thread (an end notice) may fail it
# while the main thread writes it.
_live: dict = {}
_live_lock = threading.RLock()
ORPHANED = ("the launcher ended the job before rank 0 finished (it killed rank 0's supervisor, as it kills every "
            "rank once one has died: the rank that died first is named on stderr)")

HISTORY_KEEP = 100      # the last runs listed in the report (bounded, whatever the requeue count)


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


def write_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        out.append({"rank": info.rank, "host": info.host, "threads": info.threads, "isa": info.isa,
                    "kernel": info.kernel, "kv_capacity_bytes": info.capacity_bytes, **w,
                    "kv_peak_fraction": round(w["kv_bytes_peak"] / info.capacity_bytes, 6)
                    if info.capacity_bytes else None,
                    "attend_share": round(w["attend_s"] / total_attend, 4) if total_attend else None})
    return out


def started(path: str, prev: dict, input_path: str, output_path: str, stats_json: str | None = None) -> dict:
    """The report of a run that has begun; written at once. `stats_json`: where this run's per-step
    statistics go (`fastdecode report` draws them from there)."""
    history = list(prev.get("history", []))[-HISTORY_KEEP:]
    report = {"state": "running", "runs": int(prev.get("runs", 0)) + 1, "interrupted": None,
              "input": os.path.abspath(input_path), "output": os.path.abspath(output_path),
              "stats_json": os.path.abspath(stats_json) if stats_json else None, "history": history}
    with _live_lock:
        write_atomic(path, report)
        _set_live(path, report)
    return report


def _set_live(path: str, report: dict | None) -> None:
    """The run in progress (None: no longer), and what rank 0 writes if the launcher ends it."""
    from fastdecode.launch.supervise import note_for_orphan
    _live.clear()
    if report is not None:
        _live.update(path=path, report=report)
        orphaned = dict(report, state="failed", interrupted=False, error=ORPHANED, exit_code=None)
        note_for_orphan(path, (json.dumps(orphaned, indent=1) + "\n").encode())
    else:
        note_for_orphan(None, None)


def failed(path: str, report: dict, exc: BaseException, exit_code: int = 1) -> None:
    """A run that ended by an exception: its rows so far are on disk, a rerun resumes."""
    mark_failed(path, report, f"{type(exc).__name__}: {exc}", exit_code)


def mark_failed(path: str, report: dict, error: str, exit_code: int | None, rank: int | None = None) -> bool:
    """State "failed" with its cause, unless the run already ended; True if written."""
    with _live_lock:
        if report.get("state") != "running":
            return False
        report.update(state="failed", interrupted=False, error=error, exit_code=exit_code)
        if rank is not None:
            report["failed_rank"] = rank
        write_atomic(path, report)
        if _live.get("report") is report:
            _set_live(path, None)
    return True


def fail_live(error: str, rank: int, exit_code: int | None) -> bool:
    """Fail the run in progress in this process, if there is one (rank 0, on an end notice)."""
    with _live_lock:
        return bool(_live) and mark_failed(_live["path"], _live["report"], error, exit_code, rank)


def mark_file_failed(path: str, error: str, exit_code: int | None, since: float) -> bool:
    """Rank 0's supervisor, after rank 0 ended abnormally: fail the report that run left "running"
    (written since `since`, a time.time())."""
    try:
        if os.path.getmtime(path) < since:
            return False
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(report, dict) or report.get("state") != "running":
        return False
    report.update(state="failed", interrupted=False, error=error, exit_code=exit_code, failed_rank=0)
    write_atomic(path, report)
    return True


def finished(path: str, report: dict, job, engine, this_run: dict, signal_name: str | None,
             dropped: int, sort: bool) -> dict:
    """The report of a run that ended normally; engine None: it served nothing (every line was
    answered already, or a stop came before the model load). A run a dead rank failed meanwhile
    stays failed (the job ends with an error)."""
    with _live_lock:
        if report.get("state") != "running":
            return report
        _finish(path, report, job, engine, this_run, signal_name, dropped, sort)
        _set_live(path, None)
    return report


def _finish(path: str, report: dict, job, engine, this_run: dict, signal_name: str | None,
            dropped: int, sort: bool) -> None:
    index = job.index
    interrupted = job.interrupted
    codes = index.codes(pending_prior=interrupted)
    answered = sum(codes.values()) if index.complete else job.done_lines()
    this_run = dict(this_run, skipped_done=index.skipped, retried=index.retried, errors_by_code=dict(job.errors),
                    token_latency=token_latency(engine.token_gaps.values()) if engine is not None else None)
    latency = this_run["token_latency"]
    report.update(
        state="interrupted" if interrupted else "done", interrupted=interrupted, signal=signal_name,
        **({"model": engine.served.reported, "served_model_names": list(engine.served.names)}
           if engine is not None else {}),
        # this run's rates (the Throughput line); earlier runs are in history
        throughput={k: this_run.get(k) for k in ("wall_s", "requests_per_s", "output_tokens_per_s",
                                                  "total_tokens_per_s")},
        token_latency={k: latency[k] for k in ("p50_s", "p90_s", "p99_s")} if latency else None,
        requests={"served_this_run": this_run["requests"], "errors_this_run": this_run["errors"],
                  "skipped_done_by_earlier_runs": index.skipped, "retried": index.retried},
        exit_code=75 if interrupted or job.rewrite_error else 0,
        lines={"input": job.total_lines, "answered": answered, "remaining": max(job.total_lines - answered, 0),
               "ok": codes.get("ok", 0), "errors": answered - codes.get("ok", 0)},
        errors_by_code={k: v for k, v in sorted(codes.items()) if k != "ok"},
        output_file={"sorted": bool(sort and not interrupted and not job.rewrite_error), "rows_dropped": dropped,
                     "partial_line_repaired_bytes": job.writer.repaired, "rewrite_error": job.rewrite_error},
        this_run=this_run,
        rworkers=rworker_load(engine.backend.workers, engine.recorder) if engine is not None else [])
    report["history"] = (report.pop("history") + [{
        "run": report["runs"], "state": report["state"], "signal": signal_name, "wall_s": this_run["wall_s"],
        "requests": this_run["requests"], "errors": this_run["errors"], "skipped_done": index.skipped}])[-HISTORY_KEEP:]
    write_atomic(path, report)
