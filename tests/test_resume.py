"""Resume and interruption: a job stopped by signals and rerun ends with exactly the lines of an
uninterrupted run, each custom_id once; partial lines are repaired; --overwrite starts over;
earlier rows are matched to their input lines exactly, retryable errors redone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import MPIEXEC, REPO, batch_line, read_output, run_fastdecode, write_bound_rows

N_REQ = 40


def stable(row: dict) -> str:
    """A row without its random ids and timestamp: equal across runs for greedy requests."""
    row = json.loads(json.dumps(row))
    row.pop("id", None)
    resp = row.get("response") or {}
    resp.pop("request_id", None)
    body = resp.get("body") or {}
    body.pop("id", None)
    body.pop("created", None)
    return json.dumps(row, sort_keys=True)


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    """Greedy requests (enough decode steps at --max-batch 4 to interrupt mid-run), a few bad lines."""
    tmp = tmp_path_factory.mktemp("resume")
    lines = [batch_line(f"r{i}", {"prompt": f"Item {i}: the", "max_tokens": 12, "temperature": 0,
                                  "ignore_eos": True}) for i in range(N_REQ)]
    lines.insert(5, "{not json")
    lines.insert(11, lines[2])                                            # duplicate custom_id
    lines.insert(17, batch_line("bad", {"prompt": "x", "max_tokens": "z"}))
    path = tmp / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return tmp, path, lines


@pytest.fixture(scope="module")
def reference(job_input):
    tmp, inp, lines = job_input
    out = tmp / "reference.jsonl"
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "4"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(out)
    assert len(rows) == len(lines)
    return [stable(r) for r in rows]


def start(args: list[str], ranks: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastdecode"] + args
    if ranks is not None:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def count_lines(path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def interrupt_when_grown(proc: subprocess.Popen, out, grow: int, sig: int, limit_s: float = 240) -> tuple[int, str]:
    """Signal proc once the output has `grow` more lines than now (mid-run); its exit code, stderr."""
    target = count_lines(out) + grow
    deadline = time.monotonic() + limit_s
    while count_lines(out) < target and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=limit_s)
    return proc.returncode, err


def check_whole_and_unique(out) -> list[dict]:
    data = out.read_bytes()
    assert data.endswith(b"\n")
    rows = [json.loads(line) for line in data.splitlines()]
    ids = [r["custom_id"] for r in rows if r["custom_id"] is not None
           and (r["error"] or {}).get("code") != "duplicate_custom_id"]
    assert len(ids) == len(set(ids))
    return rows


@pytest.mark.parametrize("ranks,signals", [
    (None, [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT]),
    (2, [signal.SIGUSR1] * 3),
], ids=["local", "mpiexec-n2"])
def test_three_interruptions_then_resume_equal_uninterrupted(job_input, reference, ranks, signals):
    tmp, inp, lines = job_input
    out = tmp / f"interrupted-{ranks}.jsonl"
    args = ["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "4"]
    for sig in signals:          # to mpiexec itself: hydra forwards SIGUSR1/SIGTERM/SIGINT to every rank
        before = count_lines(out)
        code, err = interrupt_when_grown(start(args, ranks), out, 3, sig)
        assert code == 75, err[-3000:]
        assert f"interrupted by {signal.Signals(sig).name}: " in err and "rerun the same command to resume" in err
        rows = check_whole_and_unique(out)
        assert before < len(rows) < len(lines)
        before_last = len(rows)
    proc = run_fastdecode(args, ranks=ranks, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"fastdecode: resuming: {out} holds {before_last} row(s) of earlier runs" in proc.stderr
    rows = read_output(out)
    assert [stable(r) for r in rows] == reference          # same lines, each once, in input order
    report = json.loads((tmp / f"interrupted-{ranks}.jsonl.summary.json").read_text())
    assert report["runs"] == 4 and report["state"] == "done" and report["interrupted"] is False
    assert [h["state"] for h in report["history"]] == ["interrupted"] * 3 + ["done"]
    assert [h["signal"] for h in report["history"][:3]] == [signal.Signals(s).name for s in signals]
    assert report["lines"] == {"input": len(lines), "answered": len(lines), "remaining": 0,
                               "ok": N_REQ, "errors": 3}
    assert sum(h["requests"] for h in report["history"]) == N_REQ    # nothing served twice
    assert report["requests"]["skipped_done_by_earlier_runs"] == before_last
    assert set(report["token_latency"]) == {"p50_s", "p90_s", "p99_s"}
    assert [w["rank"] for w in report["rworkers"]] == ([0] if ranks is None else [1])
    assert all(w["kv_tokens_peak"] > 0 and w["kv_bytes_peak"] > 0 for w in report["rworkers"])


def test_partial_last_line_is_repaired(job_input, reference):
    tmp, inp, lines = job_input
    out = tmp / "partial.jsonl"
    full = (tmp / "reference.jsonl").read_bytes()
    cut = full.rstrip(b"\n").rfind(b"\n", 0, len(full) // 2) + 1 + 40      # 40 bytes into a line
    out.write_bytes(full[:cut])
    (tmp / "partial.jsonl.fingerprints").write_bytes((tmp / "reference.jsonl.fingerprints").read_bytes())
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "8"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "removed a partial last line (40 bytes)" in proc.stderr
    assert [stable(r) for r in read_output(out)] == reference
    report = json.loads((tmp / "partial.jsonl.summary.json").read_text())
    assert report["output_file"]["partial_line_repaired_bytes"] == 40
    assert report["this_run"]["skipped_done"] == full[:cut].count(b"\n")


def test_overwrite_starts_over(job_input, reference):
    tmp, inp, _ = job_input
    out = tmp / "overwrite.jsonl"
    out.write_bytes((tmp / "reference.jsonl").read_bytes()[:2000] + b"junk from another job\n")
    (tmp / "overwrite.jsonl.summary.json").write_text(json.dumps({"runs": 7, "history": [{"run": 7}]}))
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "8",
                           "--overwrite"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [stable(r) for r in read_output(out)] == reference
    report = json.loads((tmp / "overwrite.jsonl.summary.json").read_text())
    assert report["runs"] == 1 and report["this_run"]["skipped_done"] == 0
    assert report["this_run"]["requests"] == N_REQ


def row(custom_id, rid: str, code: str | None = None) -> dict:
    if code is None:
        resp = {"status_code": 200, "request_id": rid, "body": {"choices": [{"index": 0, "text": "kept"}]}}
        return {"id": rid, "custom_id": custom_id, "response": resp, "error": None}
    return {"id": rid, "custom_id": custom_id, "response": {"status_code": 400, "request_id": rid},
            "error": {"code": code, "message": "earlier run"}}


def test_earlier_rows_match_their_lines_and_retryable_errors_are_redone(tmp_path):
    good = {"prompt": "Hi", "max_tokens": 3, "temperature": 0}
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([batch_line("A", good), "{bad 1", batch_line("A", good), batch_line("B", good),
                              batch_line("C", good), "{bad 2", batch_line("A", good)]) + "\n")
    out = tmp_path / "out.jsonl"
    write_bound_rows(inp, out, [
        (2, row(None, "keep-noid-1", "invalid_request")),
        (3, row("A", "keep-dup-1", "duplicate_custom_id")),
        (5, row("C", "drop-retryable", "kv_capacity_exceeded")),   # depends on --rworker-mem: retried
        (None, "garbage that is not a row"),
        (1, row("A", "keep-A")),
    ])
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(out)
    assert [r["custom_id"] for r in rows] == ["A", None, "A", "B", "C", None, "A"]
    assert [r["id"] for r in rows][:3] == ["keep-A", "keep-noid-1", "keep-dup-1"]
    assert not {"drop-retryable"} & {r["id"] for r in rows}
    assert rows[4]["response"]["status_code"] == 200 and rows[3]["response"]["status_code"] == 200
    assert rows[5]["error"]["code"] == "invalid_request" and rows[6]["error"]["code"] == "duplicate_custom_id"
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["output_file"]["rows_moved"] == 2
    assert report["output_file"]["moved_by_cause"] == {"superseded": 1, "junk": 1}
    moved = (tmp_path / "out.jsonl.unmatched.jsonl").read_text().splitlines()
    assert [json.loads(m)["id"] for m in moved[:1]] == ["drop-retryable"] and moved[1] == "garbage that is not a row"
    assert report["this_run"]["skipped_done"] == 3 and report["this_run"]["retried"] == 1
    assert report["this_run"]["requests"] == 2


def test_no_sort_output_keeps_completion_order_but_moves_superseded(tmp_path):
    good = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(batch_line(c, good) for c in "ABC") + "\n")
    out = tmp_path / "out.jsonl"
    write_bound_rows(inp, out, [(3, row("C", "keep-C")), (1, row("A", "drop-A", "kv_capacity_exceeded"))])
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--no-sort-output"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(out)
    assert rows[0]["id"] == "keep-C" and sorted(r["custom_id"] for r in rows) == ["A", "B", "C"]


def test_output_that_is_the_input_exits_2(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("A", {"prompt": "Hi"}) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(inp)], timeout=120)
    assert proc.returncode == 2 and "is the input file" in proc.stderr
    assert inp.read_text().count("\n") == 1


def test_failed_run_is_reported_and_a_rerun_completes_it(tmp_path):
    good = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([batch_line("A", good), "{bad", batch_line("B", good)]) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300,
                          env={"FASTDECODE_INJECT_FAULT": "0:step"})
    assert proc.returncode == 1 and "injected fault" in proc.stderr
    assert [r["custom_id"] for r in read_output(out)] == [None]       # the bad line was answered when read
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and "InjectedFault" in report["error"]
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["custom_id"] for r in read_output(out)] == ["A", None, "B"]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["runs"] == 2 and report["state"] == "done" and report["this_run"]["skipped_done"] == 1
