"""Name a rank that dies.

A process killed by the OOM killer, a segfault or `kill -9` cannot say who it was, and MPI
launchers report the processes they clean up afterwards, not the one that died first. So under
an MPI launcher each `fastdecode` rank runs as a child of a small supervisor (this module, no
MPI and no torch): the supervisor forwards signals to the child, and if the child ends
abnormally it prints which rank died and how, then exits with the child's code so the launcher
ends the job.

Signals that arrive before the child has installed its own handlers are held (the child starts
with them blocked) and delivered then, so a stop during start-up is a stop, not a kill.
If the supervisor itself dies, the kernel ends the child too (PR_SET_PDEATHSIG: SIGTERM for rank
0, which then saves and stops; SIGKILL for an R-worker, which rank 0 then names as silent), so
no orphaned rank can hold the job open.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

ENV_FLAG = "FASTDECODE_SUPERVISED"        # set in the child: the supervisor's pid
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
CLEAN_EXITS = (0, 2, 75)      # done, usage error, interrupted with work saved


def should_supervise() -> bool:
    from fastdecode.launch.mpi_env import launched_size
    return launched_size() > 1 and not os.environ.get(ENV_FLAG) and \
        os.environ.get("FASTDECODE_NO_SUPERVISOR") != "1"


def run_supervised(argv: list[str]) -> int:
    from fastdecode.batch.interrupt import STOP
    from fastdecode.launch.mpi_env import launched_rank, role_name
    rank = launched_rank()
    env = dict(os.environ, **{ENV_FLAG: str(os.getpid())})
    # The child starts with the stop signals blocked (a mask survives exec) and unblocks them once
    # its own handlers are in: a signal forwarded meanwhile waits for them instead of killing it.
    # Its own process group: a launcher that signals the group reaches it only through this
    # forwarding. close_fds=False: the launcher's PMI connection (PMI_FD) must reach the child.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        child = subprocess.Popen([sys.executable, "-m", "fastdecode"] + argv, env=env, close_fds=False,
                                 process_group=0)
    finally:
        for sig in FORWARDED:       # R-workers ignore stop signals (rank 0 shuts them down)
            signal.signal(sig, signal.SIG_IGN if rank > 0 and sig != signal.SIGUSR2 else
                          (lambda signum, _frame: child.send_signal(signum)))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    if rank == 0 and STOP.requested:      # received before the child existed (cli.main took it)
        child.send_signal(STOP.signum)
    code = child.wait()                   # retried after each forwarded signal (PEP 475)
    if code in CLEAN_EXITS or code == 1:     # 1: the child reported its own failure already
        return code
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    print(f"fastdecode: rank {rank} ({role_name(rank)} pid {child.pid} on {socket.gethostname()}) died: {how}",
          file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def child_started(rank: int) -> None:
    """In a supervised child, once its own answers to the stop signals are in: let the signals
    held since its start through, and make the kernel end this process if the supervisor dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    supervisor = int(os.environ.get(ENV_FLAG) or 0)
    if not supervisor:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM if rank == 0 else signal.SIGKILL), 0, 0, 0)
    if os.getppid() != supervisor:       # it died before the death signal was armed
        print(f"fastdecode: rank {rank}: its supervisor (pid {supervisor}) is gone; ending", file=sys.stderr,
              flush=True)
        os._exit(1)
