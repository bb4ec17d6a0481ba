"""Issue 53, item 15: a stream as input resumes, its scratch copy does not outlive a killed job,
and rows meant for stdout that never reached it fail the job. An anonymous pipe (`-i <(zcat
...)`) is bound to the SHA-256 of what it delivered, not to its /proc name, which dies with the
job; a stop's in-flight save is bound the same way."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, batch_line, read_output
from inprocess import generate

from fastdecode.batch import stdio

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
LINES = [batch_line(f"r{i}", {"prompt": f"Item {i}: the", "max_tokens": 3, "temperature": 0}) for i in range(3)]


def through_a_pipe(source, out, cwd) -> subprocess.CompletedProcess:
    """`fastdecode generate -i <(cat SOURCE) -o OUT` as a shell runs it."""
    cmd = (f"exec {shlex.quote(sys.executable)} -m fastdecode generate -i <(cat {shlex.quote(str(source))}) "
           f"-o {shlex.quote(str(out))} --quiet")
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


def test_the_same_command_with_a_process_substitution_resumes(tmp_path):
    inp, other, out = tmp_path / "in.jsonl", tmp_path / "other.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(line + "\n" for line in LINES))
    other.write_text("".join(line + "\n" for line in LINES[:2]))
    first = through_a_pipe(inp, out, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = through_a_pipe(inp, out, tmp_path)
    assert again.returncode == 0 and "already answered" in again.stderr, again.stderr[-2000:]
    assert [r["custom_id"] for r in read_output(out)] == ["r0", "r1", "r2"]
    foreign = through_a_pipe(other, out, tmp_path)                     # another stream is another input
    assert foreign.returncode == 2 and "was made from input an anonymous pipe of sha256 " in foreign.stderr, \
        foreign.stderr[-2000:]


def test_a_stopped_stream_job_continues_its_sequences(llm, tmp_path, monkeypatch):
    """Each run spools the stream to a new scratch file: the in-flight save must be bound to the
    stream, not to that file, or the rerun would start its sequences over."""
    text = "".join(batch_line(f"s{i}", {"prompt": f"Tell a story {i}:", "max_tokens": 12, "temperature": 0.8,
                                        "seed": i, "ignore_eos": True}) + "\n" for i in range(2))
    spools = [tmp_path / f"fastdecode-stream-{n}" / "input.jsonl" for n in (1, 2)]
    for spool in spools:
        spool.parent.mkdir()
        spool.write_text(text)
    monkeypatch.setattr(stdio, "STREAM_INPUTS", {str(s): "an anonymous pipe of sha256 abc" for s in spools})
    out = tmp_path / "out.jsonl"
    _, rep, code = generate(llm.engine, ["-i", str(spools[0]), "-o", str(out)], stop_at=3)
    saved = rep["this_run"]["saved_in_flight_sequences"]
    assert code == 75 and saved > 0
    _, rep, code = generate(llm.engine, ["-i", str(spools[1]), "-o", str(out)])
    assert code == 0 and rep["this_run"]["continued_sequences"] == saved, rep["this_run"]
    assert [r["custom_id"] for r in read_output(out)] == ["s0", "s1"]


def test_a_killed_jobs_scratch_copy_is_reclaimed(tmp_path):
    import fcntl
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, types
        from fastdecode.batch import stdio
        r, w = os.pipe()
        os.write(w, b'{{"custom_id": "a"}}\\n'); os.close(w)
        args = types.SimpleNamespace(input=f"/proc/self/fd/{{r}}", output="out.jsonl", index_dir={str(tmp_path)!r},
                                     summary_json=None, overwrite=False)
        stdio.take_streams(args)
        assert os.path.exists(args.input)
        os.kill(os.getpid(), signal.SIGKILL)""")], cwd=REPO, env=ENV, timeout=120, check=False)
    assert killed.returncode == -signal.SIGKILL
    (left,) = tmp_path.glob("fastdecode-stream-*")                  # what a kill -9 leaves
    held, fresh = tmp_path / "fastdecode-stream-held", tmp_path / "fastdecode-stream-fresh"
    held.mkdir(), fresh.mkdir()
    old = time.time() - 3600
    for path in (left, held):
        os.utime(path, (old, old))
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)                              # a job still running with it
    try:
        mine = stdio._scratch_dir(str(tmp_path))
        assert not left.exists() and held.exists() and fresh.exists() and os.path.isdir(mine)
    finally:
        os.close(holder)


@pytest.mark.parametrize("summary", [False, True])
def test_rows_for_stdout_whose_reader_went_away_fail_the_job(tmp_path, summary):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(line + "\n" for line in LINES))
    report = tmp_path / "run.json"
    args = ["generate", "-i", str(inp), "-o", "-", "--quiet"] + (["--summary-json", str(report)] if summary else [])
    proc = subprocess.Popen([sys.executable, "-m", "fastdecode", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV, cwd=tmp_path)
    proc.stdout.close()                                             # `| head -0`: the reader is gone
    _, err = proc.communicate(timeout=600)
    err = err.decode()
    assert proc.returncode == 1, err[-2000:]
    assert "stdout was closed by its reader: 3 of 3 rows not delivered" in err
    if summary:
        import json
        rep = json.loads(report.read_text())
        assert rep["state"] == "failed" and rep["exit_code"] == 1 and "not delivered" in rep["error"]
