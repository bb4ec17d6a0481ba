"""Stop signals and deaths under the session's MPI launcher: MPICH's hydra `mpiexec`, or Open MPI's
`mpirun` when the tests run with an mpi4py built against Open MPI (docs/usage.md, "Batch jobs:
resume, signals, SLURM", and its table of what each launcher does).

- hydra forwards SIGTERM (and SIGUSR1, SIGINT) to every rank: SIGTERM to the launcher ends in 75.
- Open MPI's mpirun forwards SIGUSR1 (75); it answers SIGTERM by tearing the job down (SIGCONT,
  SIGTERM one `odls_base_sigkill_timeout` later, SIGKILL as long again after that) and exits 1
  whatever the ranks exit with: the report still says "interrupted", every finished row kept,
  even when the step in flight outlasts that grace (here: an R-worker held by SIGSTOP).
- `kill -9` of an R-worker's processes (the one the launcher started, or with its child) leaves the
  report "failed" naming the rank, under either launcher.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import MPIEXEC, REPO, batch_line, read_output

N_LINES = 10


def launcher_flavour() -> str:
    if MPIEXEC is None:
        return "none"
    try:
        text = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text) else "hydra" if "HYDRA" in text else "unknown"


FLAVOUR = launcher_flavour()
OPENMPI = FLAVOUR == "openmpi"
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
       **({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"} if OPENMPI else {})}
# what the launcher itself exits with (docs/usage.md): mpirun after SIGTERM; either after a rank killed
MPIRUN_AFTER_SIGTERM = 1
AFTER_A_KILLED_RANK = 137 if OPENMPI else 9

pytestmark = pytest.mark.skipif(FLAVOUR not in ("hydra", "openmpi"), reason=f"launcher {MPIEXEC}: {FLAVOUR}")


def write_input(path) -> None:
    path.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": 24, "temperature": 0,
                                                 "ignore_eos": True}) + "\n" for i in range(N_LINES)))


def launch(inp, out, ranks: int = 2) -> subprocess.Popen:
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o", str(out),
           "--quiet", "--max-batch", "2", "--timeout", "60",
           "--dtype", "float32"]      # the pace these jobs were sized for: signals land while lines remain
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)


def rank_processes(job: subprocess.Popen, rank: int) -> tuple[psutil.Process | None, psutil.Process | None]:
    """(supervisor: the process the launcher started, its child) of one rank."""
    sup = child = None
    for p in psutil.Process(job.pid).children(recursive=True):
        try:
            env, cmdline = p.environ(), " ".join(p.cmdline())
        except psutil.Error:
            continue
        mine = env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK")))
        if mine == str(rank) and "fastdecode" in cmdline:
            if env.get("FASTDECODE_SUPERVISED"):
                child = p
            else:
                sup = p
    return sup, child


def rows_in(out) -> int:
    try:
        return out.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_rows(job: subprocess.Popen, out, n: int, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while rows_in(out) < n and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None and rows_in(out) >= n, "the job ended (or stalled) before it wrote rows"


def finish(job: subprocess.Popen, limit_s: float = 120) -> tuple[int, str]:
    _, err = job.communicate(timeout=limit_s)
    return job.returncode, err


def report_of(out) -> dict:
    return json.loads(open(f"{out}.summary.json").read())


def kept_rows(out) -> list[dict]:
    """Every row in the file is whole and a success, each custom_id once."""
    rows = read_output(str(out))
    assert all(r["response"]["status_code"] == 200 for r in rows)
    assert len({r["custom_id"] for r in rows}) == len(rows)
    return rows


def test_a_stop_signal_to_the_launcher_saves_and_the_rerun_completes(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    documented = signal.SIGUSR1 if OPENMPI else signal.SIGTERM      # the signal to send the launcher
    job = launch(inp, out)
    wait_rows(job, out, 2)
    job.send_signal(documented)
    code, err = finish(job)
    assert code == 75, (code, err[-3000:])
    rep, rows = report_of(out), kept_rows(out)
    assert rep["state"] == "interrupted" and rep["signal"] == documented.name and "stopping" not in rep, rep
    assert rep["lines"]["answered"] == len(rows) < N_LINES
    states = ["interrupted"]
    if OPENMPI:       # SIGTERM to mpirun itself, the step in flight held past the grace: killed, report kept
        job = launch(inp, out)
        wait_rows(job, out, len(rows) + 1)
        _, worker = rank_processes(job, 1)
        worker.send_signal(signal.SIGSTOP)
        try:
            time.sleep(0.2)
            job.send_signal(signal.SIGTERM)
            code, err = finish(job)
        finally:
            worker.kill()
        assert code == MPIRUN_AFTER_SIGTERM, (code, err[-3000:])
        rep, rows = report_of(out), kept_rows(out)
        assert rep["state"] == "interrupted" and rep["signal"] == "SIGTERM" and rep["stopping"] is True, rep
        assert rep["lines"]["answered"] == len(rows) < N_LINES
        states.append("interrupted")
    job = launch(inp, out)
    code, err = finish(job, 300)
    assert code == 0, (code, err[-3000:])
    assert [r["custom_id"] for r in read_output(str(out))] == [f"r{i}" for i in range(N_LINES)]
    rep = report_of(out)
    assert rep["state"] == "done" and rep["lines"]["answered"] == N_LINES
    assert [h["state"] for h in rep["history"]] == states + ["done"]


@pytest.mark.parametrize("victims", ["supervisor", "supervisor and child"])
def test_kill_9_of_an_rworker_leaves_a_failed_report_naming_it(tmp_path, victims):
    """The launcher's own process for rank 1 killed (and its child with it): no supervisor is left to
    tell rank 0, whose link from it closes without a bye; the report names rank 1 before the
    launcher's teardown reaches rank 0."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    job = launch(inp, out)
    wait_rows(job, out, 2)
    sup, child = rank_processes(job, 1)
    assert sup is not None and child is not None
    sup.kill()
    if victims != "supervisor":
        child.kill()
    t0 = time.monotonic()
    code, err = finish(job)
    assert time.monotonic() - t0 < 60
    assert code == AFTER_A_KILLED_RANK, (code, err[-3000:])
    rep = report_of(out)
    assert rep["state"] == "failed" and rep["failed_rank"] == 1 and rep["exit_code"] == code, rep     # the launcher's
    assert f"rank 1 (R-worker pid {child.pid} on" in rep["error"] and f"(pid {sup.pid}," in rep["error"], rep
    assert len(kept_rows(out)) >= 2


def test_a_supervisor_link_closed_without_a_bye_is_a_lost_rank():
    """The link each R-worker's supervisor holds to rank 0: a bye is a normal end; a link that
    closes without one names its rank (alone) or names none (several together: the launcher
    killed them all, which went first is unknown)."""
    from rworker.host import end_notice
    got = []
    listener = end_notice.Listener(lambda notice: got.append(notice))
    try:
        links = {}
        for rank in (1, 2, 3):
            read_end, write_end = os.pipe()
            links[rank] = end_notice.SupervisorLink(read_end, rank, f"rank {rank} (R-worker pid {100 + rank} on h)")
            os.write(write_end, json.dumps(listener.address()).encode() + b"\n")
            os.close(write_end)
            assert links[rank].address() == listener.address()
        deadline = time.monotonic() + 10
        while len(listener.watched) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(listener.watched) == [1, 2, 3]
        links[1].bye()
        links[2].conn.close()                                   # as if its process were killed
        time.sleep(2 * end_notice.SETTLE_S + 0.3)
        assert got == [{"rank": 2, "error": f"rank 2 (R-worker pid 102 on h) died: its supervisor (pid {os.getpid()}, "
                        "the process the launcher started) ended without a word: killed", "abort": True, "lost": True}]
        assert listener.gone() == {2: listener.closed[2]}
        links[3].conn.close()
        deadline = time.monotonic() + 5
        while 3 not in listener.gone() and time.monotonic() < deadline:
            time.sleep(0.01)
        both = listener.lost_notice()
        assert both["rank"] is None and "ranks 2, 3" in both["error"]
        assert len(got) == 1                                     # reported once
    finally:
        listener.close()
