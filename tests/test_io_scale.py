"""Input at scale: bad lines are answered per line among good ones; the resume index keeps
custom_ids on disk, so Python memory does not grow with the number of input lines."""
from __future__ import annotations

import json
import tracemalloc
from collections import Counter

from conftest import batch_line, read_output, run_fastdecode

from fastdecode.batch.fingerprint import raw_digest, row_digest
from fastdecode.batch.output import repair_tail
from fastdecode.batch.resume import DUP, NEW, ResumeIndex


def malformed(i: int) -> tuple[str, str]:
    """The i-th kind of bad line and the error code it must get."""
    return [("{not json", "invalid_request"),
            (json.dumps({"url": "/v1/completions", "body": {"prompt": "x"}}), "invalid_request"),
            (json.dumps({"custom_id": f"m{i}", "url": "/v1/embeddings", "body": {}}), "invalid_url"),
            (batch_line(f"m{i}", {"prompt": "x", "max_tokens": "many"}), "invalid_request"),
            (batch_line("r0", {"prompt": [300], "max_tokens": 1}), "duplicate_custom_id")][i % 5]


def test_1000_lines_10_percent_malformed(tmp_path):
    lines, want = [], Counter()
    for i in range(1000):
        if i % 10 == 5:
            text, code = malformed(i // 10)
            lines.append(text)
            want[code] += 1
        else:
            lines.append(batch_line(f"r{i}", {"prompt": [100 + i], "max_tokens": 1, "temperature": 0}))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(out)
    assert len(rows) == 1000
    ok = [r for r in rows if r["error"] is None]
    assert len(ok) == 900 and all(r["response"]["status_code"] == 200 for r in ok)
    assert Counter(r["error"]["code"] for r in rows if r["error"]) == want
    assert [r["custom_id"] for i, r in enumerate(rows) if i % 10 != 5] == [f"r{i}" for i in range(1000) if i % 10 != 5]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["lines"]["ok"] == 900 and report["lines"]["errors"] == 100
    assert report["errors_by_code"] == dict(want)
    assert report["interrupted"] is False and report["state"] == "done"
    assert set(report["throughput"]) == {"wall_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"}
    assert report["throughput"]["requests_per_s"] > 0 and report["requests"]["served_this_run"] == 900
    assert report["requests"]["skipped_done_by_earlier_runs"] == 0
    assert report["token_latency"] is None          # max_tokens=1: no gaps between tokens
    (worker,) = report["rworkers"]                 # local mode: the in-process R-part
    assert {"kv_tokens_peak", "kv_bytes_peak", "kv_tokens_mean", "attend_s", "attend_share"} <= set(worker)


def test_index_python_memory_does_not_grow_with_lines(tmp_path):
    """200k custom_ids claimed and recorded: the Python heap stays small (the ids live in SQLite)."""
    index = ResumeIndex(str(tmp_path), model="m")
    try:
        tracemalloc.start()
        for n in range(1, 200_001):
            cid = f"request-{n:09d}" if n % 1000 else "request-000000001"    # some duplicates
            digest = raw_digest(cid.encode())
            state, _, key = index.claim(n, cid, digest)
            assert state == (DUP if n % 1000 == 0 else NEW)
            index.record(n, n * 100, 100, None, row_digest(digest), key)
            if n == 20_000:
                early = tracemalloc.get_traced_memory()[0]
        late, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert late - early < 1 << 20 and peak < 4 << 20, (early, late, peak)
        assert index.answered() == 200_000
    finally:
        index.close()


def test_repair_tail_without_any_newline(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_bytes(b"x" * 200_000)           # longer than one read chunk
    assert repair_tail(str(path), chunk=4096) == 200_000 and path.read_bytes() == b""
    path.write_bytes(b'{"a": 1}\n' + b"y" * 10_000)
    assert repair_tail(str(path), chunk=4096) == 10_000 and path.read_bytes() == b'{"a": 1}\n'


def test_stop_while_indexing_earlier_rows_claims_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "a", "response": {"status_code": 200}, "error": None}) + "\n")
    index = ResumeIndex(str(tmp_path), model="m")
    try:
        assert index.load(str(out), out.stat().st_size, stop=lambda: True) is False
        try:
            index.claim(1, "a", raw_digest(b"a"))
        except RuntimeError as e:
            assert "incomplete" in str(e)
        else:
            raise AssertionError("claim on an incomplete index must raise")
    finally:
        index.close()


def test_step_recorder_keeps_bounded_evenly_spaced_rows_and_exact_totals(monkeypatch):
    """Millions of steps: the rows kept for --stats-json are bounded; totals cover every step."""
    from types import SimpleNamespace

    from fastdecode.engine import stats
    monkeypatch.setattr(stats, "MAX_ROWS", 64)
    rec = stats.StepRecorder(2)
    runner = SimpleNamespace(last_s_time=0.01, last_r_wait=0.0)
    for step in range(1, 1001):
        running = [SimpleNamespace(worker=0, kv_len=step), SimpleNamespace(worker=1, kv_len=2)]
        st = SimpleNamespace(attend_s=[0.001, 0.002], busy_s=[0.003, 0.004], kv_bytes=[step * 10, 20])
        rec.record(step, 2, running, runner, st, 0.0, 0.02, decode=True)
    assert len(rec.steps) < 64 and rec.stride == 16
    assert [r["step"] for r in rec.steps] == list(range(1, 1001, 16))
    s = rec.summary(30.0, 2000, 100, stats.np.array([]))
    assert s["steps"] == s["decode_steps"] == 1000 and s["decode_s"] == 20.0
    assert s["s_bubble_fraction"] == 0.5 and s["r_time_cv"] == 0.0
    w0, w1 = rec.per_worker()
    assert w0["kv_tokens_peak"] == 1000 and w0["kv_tokens_mean"] == 500.5 and w0["kv_bytes_peak"] == 10000
    assert w1["kv_tokens_peak"] == 2 and w1["attend_s"] == 2.0 and w1["busy_s"] == 4.0
