"""No fault can hang a job or lose finished output: stop signals at any moment of start-up, a
killed supervisor, a malformed message to an R-worker, outputs behind symlinks, a full disk at
the final rewrite, bad flags found before compute."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import MPIEXEC, REPO, batch_line, read_output, run_fastdecode
from rworker.protocol import control as P

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def write_lines(path, n: int, max_tokens=lambda i: 6) -> None:
    path.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": max_tokens(i),
                                                 "temperature": 0, "ignore_eos": True}) + "\n" for i in range(n)))


def launch(args: list[str], ranks: int, env: dict | None = None) -> subprocess.Popen:
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "fastdecode"] + args
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**ENV, **(env or {})})


def rank_processes(launcher: subprocess.Popen, rank: int) -> tuple[psutil.Process | None, psutil.Process | None]:
    """(supervisor, child) of one MPI rank below the launcher."""
    sup = child = None
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK")) == str(rank) and "fastdecode" in " ".join(p.cmdline()):
            if env.get("FASTDECODE_SUPERVISED"):
                child = p
            else:
                sup = p
    return sup, child


# ---------------------------------------------------------------------------- signals at start-up

@pytest.mark.parametrize("sig,delay,target", [(signal.SIGUSR1, 0.5, "launcher"), (signal.SIGTERM, 1.5, "rank0"),
                                              (signal.SIGUSR1, 4.0, "launcher")])
def test_a_stop_signal_during_start_up_is_a_clean_stop(tmp_path, sig, delay, target):
    """The launcher (forwarding) or rank 0's own process signalled while ranks start, MPI comes
    up, the model loads or the first requests run: exit 75, nothing lost, the rerun completes."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 6, max_tokens=lambda i: 96)    # serving outlasts the latest signal (seconds)
    job = launch(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "1"], ranks=2)
    time.sleep(delay)
    if target == "launcher":
        job.send_signal(sig)
    else:
        deadline = time.time() + 30
        while (sup := rank_processes(job, 0)[0]) is None and time.time() < deadline:
            time.sleep(0.05)
        sup.send_signal(sig)
    _, err = job.communicate(timeout=240)
    assert job.returncode == 75, (job.returncode, err[-2000:])
    again = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], ranks=2, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["custom_id"] for r in read_output(str(out))] == [f"r{i}" for i in range(6)]


# ---------------------------------------------------------------------------- a killed supervisor

def test_a_killed_supervisor_ends_the_job_naming_its_rank(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 12, max_tokens=lambda i: 24)
    job = launch(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--timeout", "10", "--max-batch", "2"],
                 ranks=3)
    deadline = time.time() + 180
    while not (out.exists() and out.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.2)
    sup, child = rank_processes(job, 2)
    assert sup is not None and child is not None
    sup.kill()
    t0 = time.time()
    _, err = job.communicate(timeout=180)
    assert time.time() - t0 < 90, "the job outlived a killed rank by more than its timeout allows"
    assert job.returncode != 0
    assert "rank 2 (R-worker" in err, err[-2000:]
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE      # ended (reaped or not)
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())   # rank 0, ended with the job, says so
    assert report["state"] == "failed", report
    # named by the link its supervisor held to rank 0 (Open MPI: the others end a second later), or
    # none where the launcher killed the other ranks with it (MPICH: at once, their links close together)
    assert (report.get("failed_rank") == 2 and f"rank 2 (R-worker pid {child.pid} on" in report["error"]) or \
        "the launcher ended the job" in report["error"], report
    kept = read_output(str(out))
    assert len(kept) >= 2 and all(r["response"]["status_code"] == 200 for r in kept)
    again = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], ranks=2, timeout=300)
    assert again.returncode == 0 and len(read_output(str(out))) == 12, again.stderr[-2000:]


def test_an_end_notice_reaches_rank_0_only_with_the_jobs_token():
    """The channel a dying rank's supervisor uses: rank 0 records a notice carrying its token and
    answers; one without it (another job, anyone on the network) is dropped unanswered."""
    from rworker.host import end_notice
    got, aborted = [], []

    def on_notice(notice: dict):
        got.append(notice)
        return (lambda: aborted.append(notice["rank"])) if notice.get("abort") else None   # after the answer

    listener = end_notice.Listener(on_notice)
    try:
        address = listener.address()
        assert end_notice.send(address, {"rank": 3, "error": "rank 3 died: killed by SIGKILL", "abort": True})
        assert got == [{"rank": 3, "error": "rank 3 died: killed by SIGKILL", "abort": True}]
        deadline = time.time() + 5
        while not aborted and time.time() < deadline:
            time.sleep(0.01)
        assert aborted == [3]
        assert not end_notice.send({**address, "token": "0" * 32}, {"rank": 4, "error": "forged"})
        assert len(got) == 1
    finally:
        listener.close()


# ---------------------------------------------------------------------------- the R-worker trusts nothing

@pytest.mark.parametrize("case,needle", [
    ("short-data", "a DECODE q/k/v message of"), ("long-data", "truncated"),
    ("unknown-id", "DECODE of sequence 7, which this worker does not hold"),
    ("negative-id", "sequence id -5"), ("huge-id", "outside 0.."),
    ("too-many-minibatches", f"at most {P.MAX_MINIBATCHES}"), ("free-unknown", "FREE of sequence 9"),
    ("prefill-again", "PREFILL of sequence 1, which this worker already holds"),
    ("fork-unknown", "PREFILL forks from sequence 9, which this worker does not hold"),
    ("bad-magic", "magic"), ("short-header", "control message of 3 words"),
])
def test_a_malformed_message_ends_the_job_naming_the_rworker(case, needle):
    t0 = time.time()
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, os.path.join(REPO, "tests", "mpi_scripts",
                                                                           "bad_sworker.py"), case],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=ENV)
    assert proc.returncode not in (0, 3), (proc.returncode, proc.stderr[-2000:])     # 3: rank 0 waited in vain
    assert time.time() - t0 < 60
    assert re.search(r"rank 1 \(R-worker on \S+\) failed", proc.stderr), proc.stderr[-2000:]
    assert needle in proc.stderr, proc.stderr[-2000:]


WORDS = st.integers(-(1 << 63), (1 << 63) - 1)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from([P.HELLO, P.PREFILL, P.DECODE, P.FREE]), head=st.lists(WORDS, min_size=5, max_size=5),
       body=st.lists(st.one_of(st.integers(-3, 70), WORDS), max_size=40))
def test_a_parser_answers_any_message_with_a_message_or_a_protocol_error(kind, head, body):
    msg = P.control(kind, 1, *head, body=[body])
    _, _, hdr, b = P.parse(msg)
    parse = {P.HELLO: P.parse_hello, P.PREFILL: P.parse_prefill, P.DECODE: P.parse_decode, P.FREE: P.parse_free}
    try:
        got = parse[kind](hdr, b)
    except P.ProtocolError:
        return
    if kind == P.DECODE:
        ids = np.concatenate(got.ids)
        assert len(got.ids) <= P.MAX_MINIBATCHES and (ids >= 0).all() and np.unique(ids).size == ids.size
    elif kind == P.FREE:
        assert (got >= 0).all() and (got <= P.MAX_SEQ_ID).all()


# ---------------------------------------------------------------------------- the output file

def test_a_symlinked_output_stays_a_link_to_the_sorted_file(tmp_path):
    inp, real, link = tmp_path / "in.jsonl", tmp_path / "data" / "real.jsonl", tmp_path / "out.jsonl"
    real.parent.mkdir()
    write_lines(inp, 6, max_tokens=lambda i: 12 - 2 * i)        # later lines finish first
    real.write_text("")
    link.symlink_to(real)
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(link), "--quiet"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert [r["custom_id"] for r in read_output(str(real))] == [f"r{i}" for i in range(6)]


@pytest.mark.parametrize("output", ["/dev/null", "fifo"])
def test_an_output_that_is_not_a_file_is_a_usage_error(tmp_path, output):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, 1)
    if output == "fifo":
        output = str(tmp_path / "fifo")
        os.mkfifo(output)
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", output, "--quiet"])
    assert proc.returncode == 2 and "is not a regular file" in proc.stderr, proc.stderr[-2000:]


def test_a_full_disk_at_the_rewrite_loses_nothing_and_the_rerun_sorts(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 6, max_tokens=lambda i: 12 - 2 * i)
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"],
                          env={"FASTDECODE_INJECT_FAULT": "0:rewrite:enospc"})
    assert proc.returncode == 75 and "the final rewrite failed" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("out.jsonl.rewrite.*.tmp"))
    rows = read_output(str(out))
    assert sorted(r["custom_id"] for r in rows) == sorted(f"r{i}" for i in range(6))
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["output_file"]["rewrite_error"] and report["exit_code"] == 75 and report["state"] == "failed"
    (tmp_path / "out.jsonl.rewrite.x1y2z3w4.tmp").write_text("left by a crash\n")      # and a crash's leftover
    again = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"])
    assert again.returncode == 0 and "left by an unfinished rewrite" in again.stderr, again.stderr[-2000:]
    assert [r["custom_id"] for r in read_output(str(out))] == [f"r{i}" for i in range(6)]
    assert not list(tmp_path.glob("out.jsonl.rewrite.*.tmp"))


# ---------------------------------------------------------------------------- flags, before compute

@pytest.mark.parametrize("flags,needle", [
    (["--stats-json", "/nonexistent/dir/stats.json"], "--stats-json"),
    (["--rworker-mem", "0"], "a memory size must be at least 1 byte"),
    (["--rworker-mem", "-5"], "a memory size must be at least 1 byte"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(tmp_path, flags, needle):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, 1)
    t0 = time.time()
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl")] + flags)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
    assert time.time() - t0 < 20


def test_a_stop_before_the_resume_scan_counts_the_rows_already_there(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 4)
    assert run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"]).returncode == 0
    write_lines(inp, 8)
    job = subprocess.Popen([sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o", str(out), "--quiet"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    time.sleep(1.0)
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 75, err[-2000:]
    assert re.search(r"(4 of 8 requests done|holds 4 rows)", err), err[-2000:]


# ---------------------------------------------------------------------------- a rank killed at start-up

@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_killed_before_mpi_is_up_ends_the_job_at_once(tmp_path, rank):
    """kill -9 of a rank's process a second after it appears (importing, before MPI_Init): the
    others, waiting in MPI_Init, end within seconds (not at their 300 s start-up watchdog)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, 2)
    job = launch(["generate", "-i", str(inp), "-o", str(out), "--quiet"], ranks=3)
    deadline = time.time() + 60
    while (child := rank_processes(job, rank)[1]) is None and time.time() < deadline:
        time.sleep(0.02)
    assert child is not None, "the rank's process never appeared"
    time.sleep(1.0)
    child.kill()
    t0 = time.time()
    try:
        _, err = job.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        for p in psutil.Process(job.pid).children(recursive=True):
            p.kill()
        job.kill()
        job.communicate()
        pytest.fail(f"the job outlived rank {rank}'s death at start-up by more than 90 s")
    assert time.time() - t0 < 60
    assert job.returncode != 0
    assert f"rank {rank} ({'S-worker' if rank == 0 else 'R-worker'} pid {child.pid} on" in err, err[-2000:]
    assert "Timeout (" not in err                                   # no rank ended by its watchdog
