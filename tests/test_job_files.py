"""The files a job writes get the output's care: one job per output (a lock the OS releases with
its holder), every written path distinct and none the input (checked before compute), modes and
owners kept, scratch indexes reclaimed, and a report whose state says how the job ended, even on
a full disk."""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, batch_line, read_output, run_fastdecode
from inprocess import generate

from fastdecode.batch import lock
from fastdecode.batch.paths import check_paths
from fastdecode.batch.resume import ResumeIndex
from fastdecode.cli import build_parser

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def write_lines(path, n: int, max_tokens=lambda i: 4) -> None:
    path.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": max_tokens(i),
                                                 "temperature": 0, "ignore_eos": True}) + "\n" for i in range(n)))


# ---------------------------------------------------------------------------- one job per output

def test_a_second_job_on_the_same_output_is_refused_at_once_and_the_first_finishes(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 8, max_tokens=lambda i: 24)
    args = ["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "2"]
    first = subprocess.Popen([sys.executable, "-m", "fastdecode"] + args, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    lock_file = tmp_path / "out.jsonl.lock"
    deadline = time.monotonic() + 120
    while f'"pid": {first.pid}' not in (lock_file.read_text() if lock_file.exists() else "") \
            and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    second = run_fastdecode(args, timeout=300)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"output {out} is in use by another job: pid {first.pid} on host {socket.gethostname()}" in second.stderr
    assert "serving" not in second.stderr and time.monotonic() - t0 < 60        # before any model load
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    rows = read_output(out)
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(8)]
    assert all(r["response"]["status_code"] == 200 for r in rows)


def test_the_lock_goes_with_its_holder_even_killed(tmp_path):
    path = str(tmp_path / "out.jsonl.lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from fastdecode.batch import lock
        lock.hold({path!r}, "output out.jsonl")
        print("held", flush=True)
        time.sleep(120)""")], stdout=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.OutputBusy, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            lock.hold(path, "output out.jsonl")
        holder.kill()
        holder.wait(timeout=30)
        assert lock.hold(path, "output out.jsonl")
    finally:
        holder.kill()
        lock.release_all()


def test_a_file_system_that_cannot_lock_is_said(tmp_path, monkeypatch, capsys):
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(lock.fcntl, "flock", refuse)
    try:
        assert lock.hold(str(tmp_path / "out.jsonl.lock"), "output out.jsonl") is False
    finally:
        lock.release_all()
    err = capsys.readouterr().err
    assert f"cannot lock {tmp_path / 'out.jsonl.lock'} (No locks available)" in err
    assert "nothing stops a second job from writing output out.jsonl" in err


# ---------------------------------------------------------------------------- paths, before compute

@pytest.mark.parametrize("flags,needle", [
    (["--summary-json", "{in}"], "--summary-json {in} is the input file"),
    (["--stats-json", "{in}"], "--stats-json {in} is the input file"),
    (["--stats-json", "{link}"], "--stats-json {link} is the input file"),                 # a hard link to it
    (["--stats-json", "{out}"], "--stats-json {out} is the output file"),
    (["--summary-json", "{out}"], "--summary-json {out} is the output file"),
    (["--summary-json", "{d}/r.json", "--stats-json", "{d}/r.json"], "--stats-json {d}/r.json is the --summary-json file"),
    (["--stats-json", "{out}.summary.json"], "--stats-json {out}.summary.json is the --summary-json file"),
    (["--stats-json", "{out}.fingerprints"], "--stats-json {out}.fingerprints is the output's request fingerprints"),
    (["--summary-json", "{out}.inflight"], "--summary-json {out}.inflight is the output's saved in-flight sequences"),
])
def test_files_the_job_writes_are_distinct_and_none_is_the_input(tmp_path, flags, needle):
    inp, out, link = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "link.jsonl"
    write_lines(inp, 1)
    os.link(inp, link)
    fill = {"in": inp, "out": out, "link": link, "d": tmp_path}
    args = build_parser().parse_args(["generate", "-i", str(inp), "-o", str(out)] + [f.format(**fill) for f in flags])
    with pytest.raises(ValueError, match=needle.format(**fill).replace(".", r"\.")):
        check_paths(args)


def test_a_report_aimed_at_the_input_is_a_usage_error_and_the_input_stays(tmp_path):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, 2)
    before = inp.read_bytes()
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--summary-json", str(inp)])
    assert proc.returncode == 2 and f"--summary-json {inp} is the input file" in proc.stderr, proc.stderr[-2000:]
    assert inp.read_bytes() == before and not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------------- modes, scratch files

def test_the_output_keeps_its_mode_and_owner_and_its_side_files_its_mode(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 4, max_tokens=lambda i: 10 - 2 * i)          # later lines finish first: a sorting rewrite
    os.close(os.open(out, os.O_WRONLY | os.O_CREAT, 0o600))
    os.chmod(out, 0o600)
    can_chown = os.geteuid() == 0
    if can_chown:
        os.chown(out, 4321, 4321)
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)], stop_at=3)
    assert code == 75 and (tmp_path / "out.jsonl.inflight").exists()
    for side in ("out.jsonl.inflight", "out.jsonl.fingerprints"):
        assert (tmp_path / side).stat().st_mode & 0o777 == 0o600, side
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    assert code == 0 and rep["output_file"]["sorted"]
    assert [r["custom_id"] for r in read_output(out)] == [f"r{i}" for i in range(4)]
    st = out.stat()
    assert st.st_mode & 0o777 == 0o600
    assert (tmp_path / "out.jsonl.fingerprints").stat().st_mode & 0o777 == 0o600
    if can_chown:
        assert (st.st_uid, st.st_gid) == (4321, 4321)


def test_scratch_indexes_left_by_killed_jobs_are_reclaimed(tmp_path):
    import fcntl
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from fastdecode.batch.resume import ResumeIndex
        ResumeIndex({str(tmp_path)!r}, model="m")
        os.kill(os.getpid(), signal.SIGKILL)""")], cwd=REPO, env=ENV, timeout=120, check=False)
    assert killed.returncode == -9
    (left,) = tmp_path.glob("fastdecode-index-*.sqlite")          # what a killed job leaves
    held, fresh, other = (tmp_path / f"fastdecode-index-{n}.sqlite" for n in ("held", "fresh", "x"))
    other = tmp_path / "other.sqlite"
    for path in (held, fresh, other):
        path.write_bytes(b"")
    old = time.time() - 3600
    for path in (left, held, other):
        os.utime(path, (old, old))
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)                           # a job still running with it
    try:
        index = ResumeIndex(str(tmp_path), model="m")
        try:
            assert not left.exists()
            assert held.exists() and fresh.exists() and other.exists()
            assert os.path.exists(index.path)
        finally:
            index.close()
        assert not os.path.exists(index.path)
    finally:
        os.close(holder)


# ---------------------------------------------------------------------------- the report says how the job ended

def test_a_failed_final_rewrite_is_a_failed_report_with_the_exit_code(llm, tmp_path, monkeypatch):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 3, max_tokens=lambda i: 6 - 2 * i)
    monkeypatch.setenv("FASTDECODE_INJECT_FAULT", "0:rewrite:enospc")
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    assert code == 75
    on_disk = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert on_disk == rep
    assert rep["state"] == "failed" and rep["exit_code"] == 75 and "the final rewrite of the output failed" in rep["error"]
    assert rep["history"][-1]["state"] == "failed"
    monkeypatch.delenv("FASTDECODE_INJECT_FAULT")
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    assert code == 0 and rep["state"] == "done" and "error" not in rep


FULL_DISK = textwrap.dedent("""
    import json, os, subprocess, sys, time
    d, inp = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", d], check=True)
    out = os.path.join(d, "out.jsonl")
    job = subprocess.Popen([sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out, "--quiet",
                            "--max-batch", "1"], stderr=subprocess.PIPE, text=True)
    while job.poll() is None and not (os.path.exists(out) and open(out, "rb").read().count(b"\\n") >= 1):
        time.sleep(0.05)
    fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT)   # the disk fills up mid-run
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        os.close(fd)
    _, err = job.communicate(timeout=600)
    with open(out + ".summary.json") as f:
        report = json.load(f)
    print(json.dumps({"rc": job.returncode, "report": report, "stderr": err[-3000:]}))
""")


def test_a_full_disk_mid_run_ends_with_a_failed_report(tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False).returncode:
        pytest.skip("needs unshare -rm (a user and mount namespace) for a small tmpfs")
    inp, d = tmp_path / "in.jsonl", tmp_path / "disk"
    d.mkdir()
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": 16, "logprobs": 5,
                                                "temperature": 0, "ignore_eos": True}) + "\n" for i in range(6)))
    proc = subprocess.run(["unshare", "-rm", sys.executable, "-c", FULL_DISK, str(d), str(inp)], capture_output=True,
                          text=True, cwd=REPO, env=ENV, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rep = result["report"]
    assert result["rc"] == 1, result["stderr"]
    assert "No space left on device" in result["stderr"]
    assert rep["state"] == "failed" and rep["exit_code"] == 1 and "No space left on device" in rep["error"], rep
