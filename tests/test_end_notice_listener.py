"""Rank 0's end-notice listener against whatever reaches its port: it listens only where the ranks
reach it, holds at most a bounded number of connections waiting for their line, gives each line a
deadline and a size cap before it is parsed, survives errors of accept, and still hears the job's
own notices during and after a flood. Under mpiexec -n 3 a flood of 1,005 connections against a
rank 0 with 512 descriptors costs neither the rows written nor the report of a killed R-worker."""
from __future__ import annotations

import errno
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import MPIEXEC, MPIEXEC_ERROR, REPO, batch_line, read_output

from rworker.host import end_notice, notice_link

FLOOD = os.path.join(REPO, "tests", "mpi_scripts", "flood.py")
FDS = 512                 # the ranks' descriptor limit in the flooded job (about 100 are the job's own)


class Recorder:
    def __init__(self):
        self.got: list[dict] = []

    def __call__(self, notice: dict):
        self.got.append(notice)

    def wait_for(self, n: int, limit_s: float = 10) -> bool:
        deadline = time.monotonic() + limit_s
        while len(self.got) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(self.got) >= n


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def listener():
    rec = Recorder()
    lst = end_notice.Listener(rec, hosts=["127.0.0.1"], max_pending=16)
    lst.rec = rec
    yield lst
    lst.close()


def test_it_listens_only_where_the_ranks_reach_rank_0():
    lst = end_notice.Listener(Recorder())
    try:
        assert [s.getsockname()[0] for s in lst.socks] == ["127.0.0.1"]       # never 0.0.0.0
    finally:
        lst.close()
    me = end_notice.whereabouts()
    here = dict(me)
    elsewhere = {"host": "another-node", "netns": 1, "ips": me["ips"][:1]}
    hosts = end_notice.listen_hosts([me, here, elsewhere])
    assert hosts[1] == ["127.0.0.1"]                       # beside rank 0: loopback
    if me["ips"]:                                          # a node elsewhere: the address routed towards it
        assert hosts[2] == [end_notice.route_source(me["ips"][0])] and "0.0.0.0" not in hosts[2]


def test_a_flood_holds_a_bounded_number_of_descriptors_and_the_jobs_notice_gets_through(listener):
    before = open_fds()
    flood = [socket.socket() for _ in range(200)]
    for s in flood:
        s.setblocking(False)
        s.connect_ex(tuple(listener.address()["endpoints"][0]))
    try:
        time.sleep(1.0)
        held = open_fds() - before - len(flood)            # the listener's side of the flood
        assert held <= listener.max_pending + 2, f"the listener holds {held} connections"
        assert end_notice.send(listener.address(), {"rank": 2, "error": "rank 2 died: killed by SIGKILL", "code": 1})
        assert listener.rec.got == [{"rank": 2, "error": "rank 2 died: killed by SIGKILL", "code": 1}]
    finally:
        for s in flood:
            s.close()


def test_a_connection_that_trickles_is_closed_at_its_deadline(listener, monkeypatch):
    monkeypatch.setattr(end_notice, "MESSAGE_S", 1.0)
    conn = socket.create_connection(listener.address()["endpoints"][0][:2])
    conn.settimeout(0.5)
    closed_at, t0 = None, time.monotonic()
    while time.monotonic() - t0 < 8 and closed_at is None:
        try:
            conn.send(b" ")                                # a byte at a time, never a line
            if conn.recv(1) == b"":
                closed_at = time.monotonic() - t0
        except TimeoutError:
            pass
        except OSError:
            closed_at = time.monotonic() - t0
    conn.close()
    assert closed_at is not None and closed_at < 4, closed_at


def test_a_line_too_long_or_too_deep_is_dropped_before_it_can_hurt(listener):
    hooked = []
    old, threading.excepthook = threading.excepthook, lambda args: hooked.append(args.exc_type)
    try:
        for payload in (b"[" * 60_000 + b"\n", b"[" * 15_000 + b"\n", b"x" * 100_000):
            with socket.create_connection(listener.address()["endpoints"][0][:2]) as conn:
                try:
                    conn.sendall(payload)
                    conn.settimeout(5)
                    assert conn.recv(16) == b""            # closed unanswered
                except ConnectionResetError:
                    pass
        assert end_notice.parse_notice(b"[" * 15_000, listener.token) is None
        assert end_notice.send(listener.address(), {"rank": 1, "error": "after the junk"})
    finally:
        threading.excepthook = old
    assert hooked == [] and listener.rec.got == [{"rank": 1, "error": "after the junk"}]


def test_an_accept_error_does_not_end_the_listener(listener, monkeypatch):
    """Out of descriptors (EMFILE) at accept: the old loop returned for good on the first error."""
    real, failures = socket.socket.accept, [5]

    def accept(self):
        if failures[0] > 0 and self.fileno() == listener.socks[0].fileno():
            failures[0] -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    assert end_notice.send(listener.address(), {"rank": 1, "error": "through"})
    assert failures[0] == 0 and listener.rec.got == [{"rank": 1, "error": "through"}]


def test_a_link_naming_a_rank_outside_the_job_is_refused():
    lst = end_notice.Listener(Recorder(), ranks=2)
    try:
        conns = []
        for rank in (0, 3, "1", 1):
            hello = {"watch": rank, "who": f"rank {rank}", "pid": 1, "token": lst.token}
            conns.append(notice_link.connect(lst.address(), (json.dumps(hello) + "\n").encode()))
        deadline = time.monotonic() + 5
        while not lst.watched and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert sorted(lst.watched) == [1]
    finally:
        for c in conns:
            c.close()
        lst.close()


# ---------------------------------------------------------------------------- a flooded job

def write_input(path, n: int, max_tokens: int) -> None:
    path.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True}) + "\n" for i in range(n)))


def launch(inp, out) -> subprocess.Popen:
    def few_descriptors():                 # ranks with 512 descriptors: a flood of 1,005 would take them all
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    cmd = [MPIEXEC, "-n", "3", sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o", str(out),
           "--quiet", "--max-batch", "2", "--timeout", "60"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=few_descriptors,  # noqa: PLW1509 - the launcher, before any thread
                            env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})


def rank_child(job: subprocess.Popen, rank: int) -> psutil.Process | None:
    for p in psutil.Process(job.pid).children(recursive=True):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK")) == str(rank) and env.get("FASTDECODE_SUPERVISED"):
            return p
    return None


def rank_supervisor(job: subprocess.Popen, rank: int) -> psutil.Process | None:
    child = rank_child(job, rank)
    try:
        return child.parent() if child is not None else None
    except psutil.Error:
        return None


def end_notice_port(job: subprocess.Popen) -> tuple[str, int]:
    """Rank 0's end-notice listener, as the link rank 1's supervisor holds to it (rank 0 has other
    listening sockets: MPI's, the launcher's)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        sup = rank_supervisor(job, 1)
        if sup is not None:
            links = [c.raddr for c in sup.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED]
            if links:
                return links[0].ip, links[0].port
        time.sleep(0.2)
    raise AssertionError("rank 1's supervisor never linked to rank 0")


def flood_job(tmp_path, n_lines: int, max_tokens: int):
    if MPIEXEC is None:
        pytest.fail(MPIEXEC_ERROR)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, n_lines, max_tokens)
    job = launch(inp, out)
    host, port = end_notice_port(job)
    flood = subprocess.Popen([sys.executable, FLOOD, host, str(port), "1005", "240"], stdout=subprocess.PIPE, text=True)
    assert flood.stdout.readline().startswith("flooding")
    return job, flood, out


def test_after_a_flood_a_killed_rworker_is_reported_with_its_rank_and_code(tmp_path):
    job, flood, out = flood_job(tmp_path, 12, 64)
    try:
        deadline = time.monotonic() + 180
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)                                    # the flood at full strength
        victim = rank_child(job, 1)
        assert victim is not None and job.poll() is None
        victim.kill()
        _, err = job.communicate(timeout=120)
    finally:
        flood.kill()
        flood.wait()
    assert job.returncode == 1, (job.returncode, err[-3000:])
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["failed_rank"] == 1 and report["exit_code"] == 1, report
    assert f"rank 1 (R-worker pid {victim.pid} on" in report["error"] and "killed by SIGKILL" in report["error"]
    rows = read_output(str(out))
    assert len(rows) >= 2 and all(r["response"]["status_code"] == 200 for r in rows)
