"""Rank 0's memory while streaming a 1 M-line batch file: it must stay flat.

The input is mostly lines that are answered without the model (so 1 M lines finish in minutes on
2 cores) but that go through every per-line structure a served line does: parsed, claimed in the
resume index (custom_id -> first line), written and flushed, recorded for the final sort. Per 100
lines: 1 served request (a 1-token prompt, max_tokens=1), 96 with a unique custom_id and a bad
field, 1 not JSON, 1 without custom_id, 1 repeating an earlier custom_id.

Scenarios, each a real `fastdecode generate` process sampled with psutil (RSS every 0.2 s):
  full    one uninterrupted run over the whole file (ending in the sorted rewrite);
  resume  a run stopped by SIGUSR1 halfway (exit 75), then the rerun that skips the answered
          half (index rebuilt from the output file) and finishes.
Memory is read against progress (output bytes written), so "flat" means: RSS at 10 % of the
output is RSS at 100 %. For scale, the bench also measures what the previous design held per
line in Python (a set of the custom_ids plus a 3 x int64 row index), for the same ids.

    python bench/input_memory_bench.py [--lines 1000000] [--ranks 3] [-o bench/results/input_memory_X.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_100 = {"served": 1, "bad_field": 96, "not_json": 1, "no_custom_id": 1, "duplicate": 1}


def write_input(path: str, lines: int) -> dict:
    counts = dict.fromkeys(PER_100, 0)
    with open(path, "w") as f:
        for i in range(lines):
            k = i % 100
            if k == 0:
                kind, body = "served", {"prompt": [100 + i % 20000], "max_tokens": 1, "temperature": 0}
            elif k == 1:
                kind = "not_json"
            elif k == 2:
                kind = "no_custom_id"
            elif k == 3 and i > 100:
                kind = "duplicate"
            else:
                kind, body = "bad_field", {"prompt": f"line {i}", "max_tokens": "many"}
            counts[kind] += 1
            if kind == "not_json":
                f.write('{"custom_id": "broken\n')
            elif kind == "no_custom_id":
                f.write(json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n")
            else:
                cid = f"req-{i - 99 if kind == 'duplicate' else i:09d}"
                if kind == "duplicate":
                    body = {"prompt": "x"}
                f.write(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return counts


def rank0_process(proc: subprocess.Popen, ranks: int | None) -> psutil.Process | None:
    """The process whose memory is rank 0's: the singleton itself, or under mpiexec the
    supervised child (FASTDECODE_SUPERVISED=1) with PMI_RANK=0."""
    if ranks is None:
        return psutil.Process(proc.pid)
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("PMI_RANK") == "0" and env.get("FASTDECODE_SUPERVISED") == "1":
            return p
    return None


def run(args: list[str], ranks: int | None, out: str, stop_at_bytes: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "fastdecode", "generate"] + args
    if ranks is not None:
        cmd = ["mpiexec", "-n", str(ranks)] + cmd
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    samples, target, signalled = [], None, False
    while proc.poll() is None:
        time.sleep(0.2)
        target = target or rank0_process(proc, ranks)
        if target is None:
            continue
        try:
            rss = target.memory_info().rss
        except psutil.Error:
            break
        if rss == 0:          # a zombie: the process has ended
            break
        size = os.path.getsize(out) if os.path.exists(out) else 0
        samples.append((round(time.perf_counter() - t0, 2), rss, size))
        if stop_at_bytes and not signalled and size >= stop_at_bytes:
            proc.send_signal(signal.SIGUSR1)
            signalled = True
    stdout, stderr = proc.communicate()
    if proc.returncode not in (0, 75):
        raise RuntimeError(f"{cmd} exited {proc.returncode}: {stderr[-3000:]}")
    return {"exit_code": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), "samples": samples,
            "throughput_line": next((ln for ln in stdout.splitlines() if ln.startswith("Throughput:")), None)}


def profile(result: dict, final_bytes: int) -> dict:
    """RSS (MiB) against this run's progress: when it had written its first new row (after model
    load and, on a rerun, after indexing and skipping the earlier rows), then 10 ... 100 % of what
    it writes. The engine's first steps allocate its working memory (torch, KV pages), so the
    steady window, whose growth is reported, starts at 10 %."""
    s = result.pop("samples")
    mib = 1 / 2**20
    start = s[0][2]
    span = max((final_bytes if result["exit_code"] == 0 else s[-1][2]) - start, 1)
    at = {}
    for frac in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        hit = next((rss for _, rss, size in s if size > start and size - start >= frac * span), None)
        if hit is not None:
            at[f"{int(frac * 100)}%"] = round(hit * mib, 1)
    serving = [rss for _, rss, size in s if size - start >= 0.1 * span]
    deciles = {}          # median RSS while the run wrote each tenth of its rows: the trend without step spikes
    for d in range(10):
        band = sorted(rss for _, rss, size in s if d / 10 <= (size - start) / span < (d + 1) / 10 and size > start)
        if band:
            deciles[f"{d * 10}-{d * 10 + 10}%"] = round(band[len(band) // 2] * mib, 1)
    result.update(output_bytes_at_start=start, rss_mib_at_progress=at, rss_mib_median_by_decile=deciles,
                  rss_mib_peak=round(max(r for _, r, _ in s) * mib, 1),
                  rss_mib_at_10pct=round(serving[0] * mib, 1) if serving else None,
                  rss_mib_max_from_10pct=round(max(serving) * mib, 1) if serving else None,
                  rss_mib_growth_from_10pct=round((max(serving) - serving[0]) * mib, 1) if serving else None,
                  samples=len(s),
                  trace_t_rssmib_outbytes=[(t, round(rss * mib, 1), size) for t, rss, size in s[:: max(1, len(s) // 150)]])
    return result


def previous_design_bytes(lines: int) -> dict:
    """What the old rank 0 kept per line in Python: seen custom_ids (a set) and a 3 x int64 row index."""
    tracemalloc.start()
    ids = {f"req-{i:09d}" for i in range(lines)}
    index = [array("q", range(lines)) for _ in range(3)]
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del ids, index
    return {"python_bytes": used, "mib": round(used / 2**20, 1), "per_line_bytes": round(used / lines, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=None, help="run under mpiexec -n RANKS (default: local mode)")
    ap.add_argument("--workdir", default=None, help="where the input/output files go (default: a temp dir)")
    ap.add_argument("--no-resume", dest="resume", action="store_false", help="only the uninterrupted run")
    ap.add_argument("-o", "--output", default=os.path.join(REPO, "bench", "results", "input_memory_devbox-2core.json"))
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="input-memory-")
    inp = os.path.join(work, "in.jsonl")
    t = time.perf_counter()
    counts = write_input(inp, a.lines)
    print(f"input: {a.lines} lines, {os.path.getsize(inp) / 2**20:.0f} MiB, {counts} "
          f"({time.perf_counter() - t:.0f} s)", flush=True)
    common = ["-i", inp, "--quiet", "--max-batch", "256"]
    result = {"what": __doc__.split("\n\n")[0], "lines": a.lines, "input_bytes": os.path.getsize(inp),
              "line_kinds": counts, "mode": f"mpiexec -n {a.ranks}" if a.ranks else "local (singleton)",
              "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                       "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1)}}

    out = os.path.join(work, "full.jsonl")
    full = run(common + ["-o", out], a.ranks, out)
    final = os.path.getsize(out)
    result["full"] = profile(full, final)
    result["full"]["output_bytes"] = final
    print("full:", _brief(result["full"]), flush=True)
    result["previous_design_python_memory"] = previous_design_bytes(a.lines)
    print("previous design:", result["previous_design_python_memory"], flush=True)

    if not a.resume:
        return _write(a.output, result)
    out = os.path.join(work, "resumed.jsonl")
    first = run(common + ["-o", out], a.ranks, out, stop_at_bytes=final // 2)
    result["resume_first_run"] = profile(first, final)
    second = run(common + ["-o", out], a.ranks, out)
    result["resume_second_run"] = profile(second, final)
    result["resumed_output_equals_full"] = _same_rows(os.path.join(work, "full.jsonl"), out)
    for k in ("resume_first_run", "resume_second_run"):
        print(f"{k}:", _brief(result[k]), flush=True)
    _write(a.output, result)


def _brief(run_result: dict) -> dict:
    return {k: v for k, v in run_result.items() if not k.startswith("trace")}


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"written {path}")


def _same_rows(a: str, b: str) -> bool:
    """Same custom_id / status / error code on every line, in the same order (ids differ per run)."""
    def key(line: str):
        r = json.loads(line)
        return r["custom_id"], r["response"]["status_code"], (r["error"] or {}).get("code")
    with open(a) as fa, open(b) as fb:
        return all(key(x) == key(y) for x, y in zip(fa, fb, strict=True))


if __name__ == "__main__":
    main()
