"""Progress in tokens: the log line's documented format under mpiexec (fields, monotone percent,
a final `done` at 100%, tokens/s), the expectation against the requests' own max_tokens and the
tokens the output reports, the bar on a terminal, and the interval's sources."""
from __future__ import annotations

import io
import json
import re

import pytest
from conftest import batch_line, read_output, run_fastdecode

from fastdecode.batch.progress import Progress, Snapshot, interval_from

# the format docs/usage.md documents, written out here rather than taken from the code
CLOCK = r"\d+:\d\d:\d\d"
LINE = re.compile(rf"^fastdecode: progress (?P<pct>\d+\.\d)% tokens=(?P<done>\d+)/(?P<expected>\d+|\?) "
                  rf"tok/s=(?P<rate>\d+\.\d) eta=(?P<eta>{CLOCK}|\?) elapsed=(?P<elapsed>{CLOCK}) "
                  r"requests=(?P<req>\d+)/(?P<req_total>\d+|\?) running=(?P<running>\d+) waiting=(?P<waiting>\d+) "
                  r"kv=(?P<kv>\d+\(\d+\.\d+%\)(?:,\d+\(\d+\.\d+%\))*)(?P<state> done| interrupted)?$")


def progress_lines(stderr: str) -> list[re.Match]:
    lines = [line for line in stderr.splitlines() if line.startswith("fastdecode: progress")]
    matches = [LINE.match(line) for line in lines]
    assert all(matches), [line for line, m in zip(lines, matches) if not m]
    return matches


def test_log_lines_under_mpiexec(tmp_path):
    max_tokens = [12, 20, 16, 24, 8, 16]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": f"Item {i}: the", "max_tokens": m, "temperature": 0,
                                                "ignore_eos": True}) + "\n" for i, m in enumerate(max_tokens)))
    out = tmp_path / "out.jsonl"
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32",
                           "--progress-interval", "0.01"], ranks=3, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = progress_lines(proc.stderr)
    # the shortest interval: a step takes longer, so the 16+ decode steps print several lines on any machine
    assert len(lines) >= 3, proc.stderr[-3000:]
    pct = [float(m["pct"]) for m in lines]
    assert pct == sorted(pct) and pct[-1] == 100.0 and max(pct[:-1]) < 100.0
    assert [m["state"] for m in lines] == [None] * (len(lines) - 1) + [" done"]
    # every line read at the start (the look-ahead holds them): the expectation is their max_tokens
    assert all(int(m["expected"]) == sum(max_tokens) for m in lines)
    generated = sum(row["response"]["body"]["usage"]["completion_tokens"] for row in read_output(out))
    assert int(lines[-1]["done"]) == generated == sum(max_tokens)
    assert all(int(m["req_total"]) == len(max_tokens) for m in lines) and lines[-1]["req"] == str(len(max_tokens))
    assert all(len(m["kv"].split(",")) == 2 for m in lines)          # two R-workers (a CPU S-worker keeps no tier)
    assert all(float(m["rate"]) > 0 for m in lines if int(m["done"]) > 0) and float(lines[-1]["rate"]) > 0
    assert any(int(m["running"]) > 0 for m in lines) and int(lines[-1]["running"]) == 0


def test_quiet_prints_no_progress(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi", "max_tokens": 3, "temperature": 0}) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--quiet",
                           "--progress-interval", "0.01"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fastdecode: progress" not in proc.stderr


class Feed:
    """Snapshots a test scripts: the expectation rises mid-run (a long request read late)."""

    def __init__(self, steps):
        self.steps, self.i = steps, 0

    def __call__(self) -> Snapshot:
        done, expected = self.steps[min(self.i, len(self.steps) - 1)]
        self.i += 1
        return Snapshot(done, expected, 0, 4, 2, 1, [10, 30], [100, 100])


def test_percent_never_goes_back_and_the_last_line_says_done(monkeypatch):
    stream = io.StringIO()
    feed = Feed([(10, 100), (20, 400), (30, 100), (99, 100), (100, 100)])
    progress = Progress(feed, interval=1e-9, stream=stream)
    for _ in range(4):
        progress.update()
    progress.finish("done")
    lines = progress_lines(stream.getvalue())
    assert [float(m["pct"]) for m in lines] == [10.0, 10.0, 30.0, 99.0, 100.0]
    assert lines[-1]["state"] == " done" and lines[0]["kv"] == "10(10.00%),30(30.00%)"


def test_a_terminal_gets_a_bar_not_log_lines():
    stream = io.StringIO()
    progress = Progress(Feed([(5, 50), (50, 50)]), interval=1e-9, stream=stream, bar=True)
    bar = progress.bar
    assert bar is not None
    progress.last = -1e9                    # rendering is throttled: draw now
    progress.update()
    assert (bar.n, bar.total) == (5, 50)
    progress.finish("done")
    assert "fastdecode: progress" not in stream.getvalue() and "5/50" in stream.getvalue()


def test_interval_sources(monkeypatch):
    monkeypatch.delenv("FASTDECODE_PROGRESS_INTERVAL", raising=False)
    assert interval_from(None) == 10.0
    monkeypatch.setenv("FASTDECODE_PROGRESS_INTERVAL", "2.5")
    assert interval_from(None) == 2.5 and interval_from(0.5) == 0.5
    for bad in ("soon", "0", "-1", "nan"):
        monkeypatch.setenv("FASTDECODE_PROGRESS_INTERVAL", bad)
        with pytest.raises(ValueError, match="FASTDECODE_PROGRESS_INTERVAL"):
            interval_from(None)


def test_bad_interval_variable_is_a_usage_error(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x"}}) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "o.jsonl")], timeout=120,
                          env={"FASTDECODE_PROGRESS_INTERVAL": "often"})
    assert proc.returncode == 2 and "FASTDECODE_PROGRESS_INTERVAL" in proc.stderr
