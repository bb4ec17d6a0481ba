"""Hostile input at scale: `mpiexec -n 3 fastdecode generate` over >= 10,000 generated lines, half
of them hostile (tests/hostile_lines.py: wrong types, non-finite or huge numbers, ids outside the
vocabulary, limits passed, broken JSON, invalid UTF-8, raw CR, deep nesting), the rest short good
requests. The job must end with exit 0, one row per line in input order, every good line served
and every hostile one a 400. Records the lines tried, the job's crashes (0), rows that disagree
(0), rank 0's peak memory and the wall time, and as their peer the same job over the good lines
alone (what the hostile half costs). Writes bench/e2e/results/fuzz_<label>.json.

    python3 bench/e2e/fuzz_bench.py [--label NAME] [--lines 10000] [--ranks 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from hypothesis import given, settings  # noqa: E402
from hostile_lines import batch  # noqa: E402

PER_EXAMPLE = 100


def generate_lines(count: int) -> list[tuple[bytes, str | None, bool]]:
    """`count` lines drawn from the strategies, the same on every run (derandomized)."""
    out: list = []

    @settings(max_examples=-(-count // PER_EXAMPLE), derandomize=True, database=None, deadline=None)
    @given(batch(size=PER_EXAMPLE, prefix=""))
    def draw(lines):
        base = len(out)
        for data, cid, good in lines:       # custom_ids unique across examples
            k = len(out)
            out.append((data.replace(f'"custom_id": "{cid}"'.encode(), f'"custom_id": "{k}"'.encode(), 1)
                        if cid is not None else data, None if cid is None else str(k), good))
        assert len(out) == base + len(lines)

    draw()
    return out[:count]


class PeakRss(threading.Thread):
    """Rank 0's resident memory, polled (its supervised child: PMI_RANK=0)."""

    def __init__(self, launcher: subprocess.Popen):
        super().__init__(daemon=True)
        self.launcher, self.peak, self.done = launcher, 0, False

    def run(self) -> None:
        while not self.done:
            try:
                for p in psutil.Process(self.launcher.pid).children(recursive=True):
                    env = p.environ()
                    if env.get("PMI_RANK") == "0" and env.get("FASTDECODE_SUPERVISED"):
                        self.peak = max(self.peak, p.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.2)


def run_job(lines, ranks: int, workdir: str) -> dict:
    inp, out = os.path.join(workdir, "in.jsonl"), os.path.join(workdir, "out.jsonl")
    with open(inp, "wb") as f:
        f.write(b"\n".join(data for data, _, _ in lines) + b"\n")
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out,
           "--quiet", "--timeout", "120"]
    env = {**os.environ, "PYTHONPATH": REPO}
    start = time.perf_counter()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    rss = PeakRss(job)
    rss.start()
    _, err = job.communicate()
    rss.done = True
    wall = time.perf_counter() - start
    with open(out, "rb") as f:
        rows = [json.loads(r) for r in f.read().splitlines()]
    return {"exit_code": job.returncode, "wall_s": round(wall, 1), "rank0_peak_rss_mib": round(rss.peak / 2**20, 1),
            "rows": rows, "stderr_tail": err[-1500:]}


def check(lines, rows: list[dict]) -> dict:
    """Rows against the lines: one per line, in order, good 200 and hostile 400."""
    wrong = []
    for i, (row, (data, cid, good)) in enumerate(zip(rows, lines)):
        status = row["response"]["status_code"]
        if row["custom_id"] != cid or status != (200 if good else 400):
            wrong.append({"line": i + 1, "custom_id": row["custom_id"], "status": status, "good": good,
                          "line_head": data[:160].decode("utf-8", "replace")})
    codes: dict[str, int] = {}
    for row in rows:
        if row.get("error"):
            codes[row["error"]["code"]] = codes.get(row["error"]["code"], 0) + 1
    return {"rows_missing": max(len(lines) - len(rows), 0), "rows_wrong": len(wrong), "wrong_first": wrong[:10],
            "errors_by_code": dict(sorted(codes.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="devbox-2core")
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=3)
    args = ap.parse_args()
    lines = generate_lines(args.lines)
    with tempfile.TemporaryDirectory() as d:
        job = run_job(lines, args.ranks, d)
    with tempfile.TemporaryDirectory() as d:
        peer = run_job([x for x in lines if x[2]], args.ranks, d)
    result = {"label": args.label, "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "cpus": os.cpu_count(), "ranks": args.ranks, "lines_tried": len(lines),
              "good_lines": sum(g for _, _, g in lines), "hostile_lines": sum(not g for _, _, g in lines),
              "job_crashes": int(job["exit_code"] != 0), **{k: job[k] for k in ("exit_code", "wall_s",
                                                                                 "rank0_peak_rss_mib")},
              **check(lines, job["rows"]),
              "peer_good_lines_only": {k: peer[k] for k in ("exit_code", "wall_s", "rank0_peak_rss_mib")}}
    result["rank0_peak_rss_vs_peer"] = round(job["rank0_peak_rss_mib"] / max(peer["rank0_peak_rss_mib"], 1e-9), 3)
    result["wall_vs_peer"] = round(job["wall_s"] / max(peer["wall_s"], 1e-9), 3)
    if job["exit_code"] != 0:
        result["stderr_tail"] = job["stderr_tail"]
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"fuzz_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("wrong_first",)}, indent=1))
    print(f"written {path}")
    return 0 if result["job_crashes"] == 0 and result["rows_wrong"] == 0 and result["rows_missing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
