"""Signals and reports: a SIGUSR2 from anyone but the kernel (the supervisor alive) is no death;
SIGHUP to rank 0 is a stop like SIGTERM (finish the step, save, exit 75); a silent rank 0 is
named as the silent one; the report's exit code is the launcher's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import MPIEXEC, MPIEXEC_ERROR, REPO, batch_line, read_output, run_fastdecode

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def write_input(path, n: int, max_tokens: int) -> None:
    path.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True}) + "\n" for i in range(n)))


def test_a_stray_sigusr2_is_not_taken_for_the_supervisors_death():
    """The rank's handler for the kernel's parent-death signal checks its parent first: here the
    "supervisor" (this test) is alive, so the rank goes on. The old handler ended it at once,
    saying its supervisor had died."""
    code = ("import sys, time\nfrom fastdecode.launch.supervise import child_started\nchild_started(0)\n"
            "print('ready', flush=True)\ntime.sleep(2)\nprint('alive', flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**ENV, "FASTDECODE_SUPERVISED": str(os.getpid())})
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGUSR2)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0 and out.strip() == "alive", (child.returncode, err)
    assert f"got SIGUSR2, but its supervisor (pid {os.getpid()}) is alive: ignored" in err
    assert "died" not in err


def wait_rows(out, n: int, job: subprocess.Popen, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while not (out.exists() and out.read_text().count("\n") >= n) and job.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.poll() is None, "the job ended before it was signalled"


def test_sighup_to_rank_0_is_a_clean_stop_and_the_rerun_completes(tmp_path):
    """Local mode (rank 0 alone): SIGHUP finishes the step, saves, exits 75. The old rank 0 took
    SIGHUP's default action, death, with the report still "running"."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 4, 32)
    job = subprocess.Popen([sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o", str(out), "--quiet",
                            "--max-batch", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env=ENV)
    wait_rows(out, 1, job)
    job.send_signal(signal.SIGHUP)
    _, err = job.communicate(timeout=240)
    assert job.returncode == 75, (job.returncode, err[-2000:])
    assert "got SIGHUP: stopping after the step in flight" in err
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "interrupted" and report["signal"] == "SIGHUP", report
    again = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["custom_id"] for r in read_output(str(out))] == [f"r{i}" for i in range(4)]


def test_the_launcher_exit_code_rank_0_reports_is_the_launchers():
    from fastdecode.launch.supervise import launcher_exit_code
    assert launcher_exit_code(-9, "hydra_pmi_proxy") == 9 and launcher_exit_code(17, "hydra_pmi_proxy") == 9
    assert launcher_exit_code(-9, "orted") == 137 and launcher_exit_code(17, "prted") == 17
    assert launcher_exit_code(-9, "slurmstepd") is None


@pytest.mark.parametrize("fault,code,rank,needle", [
    ("0:step:hang", 75, 0, "rank 0 (S-worker) is silent: no message from rank 0 (S-worker) within"),
    ("0:step:kill", None, 0, "died: killed by SIGKILL"),
])
def test_rank_0_silent_or_killed_is_reported_with_the_launchers_exit_code(tmp_path, fault, code, rank, needle):
    """Under mpiexec -n 2. A rank 0 that hangs: the R-worker names rank 0 as the silent one (the old
    report named the R-worker, or no rank) and the job exits 75. A rank 0 killed: the report's
    exit_code is what the launcher exits with (hydra: 9, where the old report said 137)."""
    if MPIEXEC is None:
        pytest.fail(MPIEXEC_ERROR)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 4, 8)
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o",
                           str(out), "--quiet", "--timeout", "8"], capture_output=True, text=True, cwd=REPO, check=False,
                          timeout=300, env={**ENV, "FASTDECODE_INJECT_FAULT": fault})
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["failed_rank"] == rank, (report, proc.stderr[-2000:])
    assert needle in report["error"], report
    assert report["exit_code"] == proc.returncode, (report["exit_code"], proc.returncode, proc.stderr[-2000:])
    if code is not None:
        assert proc.returncode == code


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR2])
def test_a_signal_that_kills_hydras_mpiexec_is_reported_as_the_launchers_death(tmp_path, sig):
    """MPICH's mpiexec does not catch SIGHUP or SIGUSR2: it dies of it and its proxies end every
    rank. The report says the launcher died, names no rank and claims no exit code (the old report
    named rank 1 as dead and said exit_code 9, what hydra exits with after a rank died, while
    mpiexec died of the signal: 129, 140)."""
    from test_launcher_signals import FLAVOUR
    if FLAVOUR != "hydra":
        pytest.skip(f"MPICH's hydra mpiexec only (here: {FLAVOUR})")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 10, 24)
    job = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o",
                            str(out), "--quiet", "--max-batch", "2", "--timeout", "60"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    wait_rows(out, 2, job)
    job.send_signal(sig)
    _, err = job.communicate(timeout=120)
    assert job.returncode == -sig, (job.returncode, err[-2000:])          # a shell says 128 + N
    deadline = time.monotonic() + 30                                       # the ranks end after the launcher
    while json.loads((tmp_path / "out.jsonl.summary.json").read_text())["state"] == "running" \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["exit_code"] is None and "failed_rank" not in report, report
    assert f"the launcher (mpiexec pid {job.pid}) died before the job ended" in report["error"], report
    assert len(read_output(str(out))) >= 2
