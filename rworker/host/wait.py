"""Waiting on MPI requests without starving other ranks.

MPICH's blocking calls busy-poll. With more ranks than cores (CI runs 3 ranks on 2 cores) a
spinning rank steals the core the rank it waits for needs. So we poll with Test and, after a
short spin, sleep with exponential backoff. `spin` is right when every rank has its own cores.
"""
from __future__ import annotations

import os
import socket
import sys
import time

from mpi4py import MPI

SPIN_S = {"spin": float("inf"), "adaptive": 200e-6, "sleep": 0.0}
MAX_SLEEP_S = 1e-3


class PeerTimeout(RuntimeError):
    """A peer rank sent nothing within the allowed time."""


def choose_policy(ranks_here: int, threads_here: int) -> str:
    """FASTDECODE_WAIT overrides; else spin briefly only when this node is not oversubscribed.

    ranks_here: MPI ranks on this node; threads_here: compute threads they run in total.
    """
    env = os.environ.get("FASTDECODE_WAIT")
    if env:
        if env not in SPIN_S:
            raise ValueError(f"FASTDECODE_WAIT={env!r}: expected one of {', '.join(SPIN_S)}")
        return env
    cores = os.cpu_count() or 1
    return "adaptive" if max(ranks_here, threads_here) <= cores else "sleep"


def node_layout(comm: MPI.Comm, s_ranks: int = 1) -> tuple[int, int, int]:
    """Collective over comm: (ranks on this node, how many of them are S-worker ranks, my index
    among them). The S-worker is ranks 0..s_ranks-1 (a tensor-parallel one has several); being the
    lowest world ranks they come first on their node."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)     # ordered by world rank: the S-ranks first if here
    try:
        return local.Get_size(), int(local.allreduce(1 if comm.Get_rank() < s_ranks else 0)), local.Get_rank()
    finally:
        local.Free()


def wait_all(requests: list[MPI.Request], policy: str = "adaptive", timeout: float | None = None,
             who: str = "peer", statuses: list[MPI.Status] | None = None) -> None:
    """Complete all requests (their statuses into `statuses`); raise PeerTimeout naming `who` after
    `timeout` seconds."""
    if not requests:
        return
    if MPI.Request.Testall(requests, statuses):
        return
    start = time.perf_counter()
    spin_until = start + SPIN_S[policy]
    delay = 10e-6
    while not MPI.Request.Testall(requests, statuses):
        now = time.perf_counter()
        if timeout is not None and now - start > timeout:
            raise PeerTimeout(f"no reply from {who} within {timeout:.0f} s")
        if now < spin_until:
            continue
        time.sleep(delay)
        delay = min(delay * 2, MAX_SLEEP_S)


def wait_message(comm: MPI.Comm, source: int, tag: int, policy: str = "adaptive",
                 timeout: float | None = None, who: str = "peer") -> MPI.Status:
    """Block (politely) until a message from source/tag is available; return its status."""
    status = MPI.Status()
    if comm.Iprobe(source, tag, status):
        return status
    start = time.perf_counter()
    spin_until = start + SPIN_S[policy]
    delay = 10e-6
    while not comm.Iprobe(source, tag, status):
        now = time.perf_counter()
        if timeout is not None and now - start > timeout:
            raise PeerTimeout(f"no message from {who} within {timeout:.0f} s")
        if now < spin_until:
            continue
        time.sleep(delay)
        delay = min(delay * 2, MAX_SLEEP_S)
    return status


def abort_job(comm, code: int) -> None:
    """MPI_Abort after a moment: the abort has the launcher tear down every rank and its output
    forwarding, and the line naming the failed rank, just written, was lost now and then (hydra)."""
    sys.stderr.flush()
    time.sleep(0.5)
    comm.Abort(code)


def end_job_on_error(comm, e: BaseException, role: str, end_notice_to: dict | None, code: int = 1) -> None:
    """A rank other than 0 failed: name it (stderr, and rank 0's end-notice listener for its run
    report) and abort every rank. A PeerTimeout means this rank waited on rank 0 in vain: rank 0
    is the silent one, exit 75 (requeue: the outputs are saved)."""
    from rworker.host import end_notice
    from rworker.host.launcher_env import world_rank_or
    rank, host = world_rank_or(comm.Get_rank()), socket.gethostname()
    if isinstance(e, PeerTimeout):
        culprit, code = 0, 75
        text = f"rank 0 (S-worker) is silent: {e} (seen by rank {rank}, {role} on {host})"
    else:
        culprit = rank
        text = f"rank {rank} ({role} on {host}) failed: {type(e).__name__}: {e}"
    print(f"fastdecode: {text}", file=sys.stderr, flush=True)
    if end_notice_to is not None:
        end_notice.send(end_notice_to, {"rank": culprit, "error": text, "code": code, "abort": False})
    abort_job(comm, code)
