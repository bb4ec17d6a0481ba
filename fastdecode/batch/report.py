"""The run report next to the output (`OUT.jsonl.summary.json`): what the file holds, what this
run did, and how the R-workers were loaded. Written when a run starts (state "running", so a
run that died is visible) and again when it ends ("done" or "interrupted"); `runs` counts the
runs of this output since it was started (or --overwrite); state "failed" names the exception."""
from __future__ import annotations

import json
import os

import numpy as np

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


def started(path: str, prev: dict, input_path: str, output_path: str) -> dict:
    """The report of a run that has begun; written at once."""
    history = list(prev.get("history", []))[-HISTORY_KEEP:]
    report = {"state": "running", "runs": int(prev.get("runs", 0)) + 1, "interrupted": None,
              "input": os.path.abspath(input_path), "output": os.path.abspath(output_path),
              "history": history}
    write_atomic(path, report)
    return report


def failed(path: str, report: dict, exc: BaseException) -> None:
    """A run that ended by an exception: its rows so far are on disk, a rerun resumes."""
    report.update(state="failed", interrupted=False, error=f"{type(exc).__name__}: {exc}")
    write_atomic(path, report)


def finished(path: str, report: dict, job, engine, this_run: dict, signal_name: str | None,
             dropped: int, sort: bool) -> dict:
    """The report of a run that ended normally; engine None: it served nothing (every line was
    answered already, or a stop came before the model load)."""
    index = job.index
    interrupted = job.interrupted
    codes = index.codes(pending_prior=interrupted)
    answered = sum(codes.values()) if index.complete else job.done_lines()
    this_run = dict(this_run, skipped_done=index.skipped, retried=index.retried, errors_by_code=dict(job.errors),
                    token_latency=token_latency(engine.token_gaps.values()) if engine is not None else None)
    latency = this_run["token_latency"]
    report.update(
        state="interrupted" if interrupted else "done", interrupted=interrupted, signal=signal_name,
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
    return report
