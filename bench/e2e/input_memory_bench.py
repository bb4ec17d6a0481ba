"""Rank 0's memory while streaming a 1 M-line batch file through `generate`: it must stay flat.

What runs: the input pipeline of rank 0, in this process, exactly as `fastdecode generate` runs
it (generate.BatchJob + BatchRunner: streamed read, parse, validate, duplicate check and resume
matching in the scratch SQLite index, output rows appended and flushed, the row index for the
final sort, the sorted atomic rewrite, the report) with the model replaced by a stub engine that
finishes every admitted request in the next step with one token. So the numbers are the
pipeline's own: the model's memory does not depend on the number of input lines.

Input, per 100 lines: 97 served (a 1-token prompt given as token ids, max_tokens=1), 1 not JSON,
1 without custom_id, 1 repeating an earlier custom_id.

Scenarios:
  full    one uninterrupted run over the whole file;
  resume  a run stopped halfway (the stop flag a SIGUSR1 sets), then the rerun that rebuilds the
          index from the output, skips the answered half and finishes; its output must equal
          the full run's (custom_id, status, error code on every line, in input order).
Each run is a fresh process; RSS is its resident set (/proc/self/statm) read every 10 k lines
processed (answered: written this run or skipped as done), and once after the final rewrite.
The scratch index's SQLite page cache is capped (resume.CACHE_KIB): RSS grows while that cache
fills, then stays flat.

    python3 bench/e2e/input_memory_bench.py [--lines 1000000] [-o bench/e2e/results/input_memory_devbox-2core.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)

from fastdecode.batch import report  # noqa: E402
from fastdecode.batch.generate import BatchJob  # noqa: E402
from fastdecode.engine.request_checks import RequestError  # noqa: E402
from fastdecode.engine.sampling_params import CompletionOutput, RequestOutput  # noqa: E402
from fastdecode.engine.stats import Reservoir, StepRecorder  # noqa: E402
from fastdecode.rpart.base import WorkerInfo  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_EVERY = 10_000
MARKS = (10_000, 100_000, 1_000_000)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# ---------------------------------------------------------------------------- the stub engine

class StubEngine:
    """What BatchRunner and the report use of LLMEngine; every request ends in one step."""

    def __init__(self, max_batch: int, on_step):
        self.args = SimpleNamespace(max_batch=max_batch)
        self.scheduler = SimpleNamespace(waiting=[])
        # prompts are token ids and nothing is echoed: only the first prompt token's text is asked for
        self.tokenizer = SimpleNamespace(token_text=lambda token_id: "")
        self.source = SimpleNamespace(name="stub")
        self.served = SimpleNamespace(reported="stub", names=("stub",), mismatch=lambda model: None)  # serves any name
        self.backend = SimpleNamespace(workers=[WorkerInfo(rank=0, host="stub", threads=1, isa="none",
                                                           capacity_bytes=0)])
        self.recorder = StepRecorder(1)
        self.token_gaps = Reservoir(size=1024)
        self.num_prompt_tokens = self.num_output_tokens = 0
        self.pinned_bytes = 0              # nothing is held per request: the index and the reader are measured
        self.on_step = on_step

    def add_request(self, index, request_id, prompt, ids, params, resume=None):
        if not ids:
            raise RequestError("the prompt is empty (no tokens)")
        req = SimpleNamespace(index=index, request_id=request_id, prompt=prompt, prompt_ids=list(ids), params=params,
                              finished=False, sequences=[], meta={})       # nothing generated before a step
        self.scheduler.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting)

    def step(self):
        done = self.scheduler.waiting[: self.args.max_batch]
        del self.scheduler.waiting[: self.args.max_batch]
        self.num_prompt_tokens += sum(len(r.prompt_ids) for r in done)
        self.num_output_tokens += len(done)
        self.on_step()
        return done

    def output_of(self, req) -> RequestOutput:
        return RequestOutput(req.request_id, None, req.prompt_ids, [CompletionOutput(0, "", [7], "length")])

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- input and runs

def write_input(path: str, lines: int) -> dict:
    counts = {"served": 0, "not_json": 0, "no_custom_id": 0, "duplicate": 0}
    with open(path, "w") as f:
        for i in range(lines):
            k = i % 100
            if k == 1:
                counts["not_json"] += 1
                f.write('{"custom_id": "broken\n')
                continue
            if k == 2:
                counts["no_custom_id"] += 1
                f.write(json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": [5]}}) + "\n")
                continue
            dup = k == 3 and i > 100
            counts["duplicate" if dup else "served"] += 1
            cid = f"req-{i - 99 if dup else i:09d}"
            body = {"prompt": [100 + i % 20000], "max_tokens": 1, "temperature": 0}
            f.write(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return counts


class Stop:
    """generate's StopRequest as the runner sees it; set by the bench instead of a signal."""
    requested = False
    name = "SIGUSR1"


def run_once(inp: str, out: str, stop_after: int | None = None, max_batch: int = 256) -> dict:
    """One `generate` run (resume if `out` exists); RSS against lines processed."""
    stop = Stop()
    samples: list[tuple[int, int, float]] = []         # (lines processed, rss bytes, seconds)
    t0 = time.perf_counter()
    job: BatchJob | None = None

    def on_step():
        done = job.index.skipped + job.writer.count
        if not samples or done - samples[-1][0] >= SAMPLE_EVERY:
            samples.append((done, rss_bytes(), round(time.perf_counter() - t0, 2)))
        if stop_after is not None and done >= stop_after:
            stop.requested = True

    engine = StubEngine(max_batch, on_step)
    rss_start = rss_bytes()
    with BatchJob(inp, out, stop=stop) as job:
        t_index = time.perf_counter() - t0
        interrupted = job.run(engine, show_progress=False)
        t_run = time.perf_counter() - t0
        dropped = job.finish(sort=True)
        summary = {"wall_s": job.wall, "requests": job.runner.num_requests, "errors": job.runner.num_errors,
                   "output_tokens": engine.num_output_tokens, "prompt_tokens": engine.num_prompt_tokens}
        rep = report.started(out + ".summary.json", {}, inp, out)
        report.finished(out + ".summary.json", rep, job, engine, summary, stop.name if interrupted else None,
                        dropped, True)
        done = job.index.skipped + job.writer.count
        samples.append((done, rss_bytes(), round(time.perf_counter() - t0, 2)))
    mib = 1 / 2**20
    at = {}
    for mark in MARKS:
        hit = next(((n, r) for n, r, _ in samples if n >= mark), None)
        if hit is not None:
            at[f"{mark}"] = {"lines": hit[0], "rss_mib": round(hit[1] * mib, 1)}
    result = {"interrupted": interrupted, "lines_processed": done, "served": job.runner.num_requests,
              "errors": job.runner.num_errors, "skipped_done": job.index.skipped,
              "index_scan_s": round(t_index, 2), "serve_s": round(t_run - t_index, 2),
              "finish_s": round(time.perf_counter() - t0 - t_run, 2),
              "rss_mib_at_start": round(rss_start * mib, 1), "rss_mib_at_lines": at,
              "rss_mib_after_rewrite": round(samples[-1][1] * mib, 1),
              "rss_mib_peak": round(max(r for _, r, _ in samples) * mib, 1)}
    serving = samples[:-1]                        # the last sample is after the rewrite
    for name, lo, hi in (("10_to_100pct", 0.1, 1.0), ("last_30pct", 0.7, 1.0)):
        # RSS growth per line processed between two points of the run
        window = [x for x in serving if lo * done <= x[0] <= hi * done]
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            result[f"rss_slope_bytes_per_line_{name}"] = round(
                (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]), 2)
    result["trace_lines_rssmib_s"] = [(n, round(r * mib, 1), t) for n, r, t in samples[:: max(1, len(samples) // 100)]]
    return result


def same_rows(a: str, b: str) -> bool:
    def key(line: str):
        r = json.loads(line)
        return r["custom_id"], r["response"]["status_code"], (r["error"] or {}).get("code")
    with open(a) as fa, open(b) as fb:
        return all(key(x) == key(y) for x, y in zip(fa, fb, strict=True))


def previous_design_bytes(lines: int) -> dict:
    """For scale: what the previous rank 0 kept per line in Python (a set of the custom_ids for
    the duplicate check, and a 3 x int64 row index for the final sort)."""
    import tracemalloc
    from array import array
    tracemalloc.start()
    ids = {f"req-{i:09d}" for i in range(lines)}
    index = [array("q", range(lines)) for _ in range(3)]
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del ids, index
    return {"mib": round(used / 2**20, 1), "per_line_bytes": round(used / lines, 1)}


def run_in_child(inp: str, out: str, stop_after: int | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", inp, out, str(stop_after or 0)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr[-3000:]}")
    sys.stderr.write(proc.stderr)
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        inp, out, stop_after = sys.argv[2:5]
        r = run_once(inp, out, int(stop_after) or None)
        r["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        print(json.dumps(r))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--workdir", default=None, help="input/output files (default: a temp dir, removed)")
    ap.add_argument("-o", "--output", default=os.path.join(RESULTS, "input_memory_devbox-2core.json"))
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="input-memory-")
    try:
        inp = os.path.join(work, "in.jsonl")
        t = time.perf_counter()
        counts = write_input(inp, a.lines)
        print(f"input: {a.lines} lines, {os.path.getsize(inp) / 2**20:.0f} MiB, {counts} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        result = {"what": __doc__.split("\n\n")[0],
                  "engine": "stub (input pipeline only: generate.BatchJob/BatchRunner with an engine that "
                            "finishes each request in one step; no model)",
                  "lines": a.lines, "input_bytes": os.path.getsize(inp), "line_kinds": counts,
                  "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "machine": platform.machine()}}
        full, resumed = os.path.join(work, "full.jsonl"), os.path.join(work, "resumed.jsonl")
        for key, out, stop_after in (("full", full, None), ("resume_first_run", resumed, a.lines // 2),
                                     ("resume_second_run", resumed, None)):
            result[key] = run_in_child(inp, out, stop_after)     # a fresh process each: its own RSS
            print(f"{key}:", brief(result[key]), flush=True)
        result["full"]["output_bytes"] = os.path.getsize(full)
        result["resumed_output_equals_full"] = same_rows(full, resumed)
        result["previous_design_python_memory"] = previous_design_bytes(a.lines)
        print("resumed output equals full:", result["resumed_output_equals_full"])
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    with open(a.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"written {a.output}")


def brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("trace")}


if __name__ == "__main__":
    main()
