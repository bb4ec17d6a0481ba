"""Name a rank that dies.

A process killed by the OOM killer, a segfault or `kill -9` cannot say who it was, and MPI
launchers report the processes they clean up afterwards, not the one that died first. So under
an MPI launcher each `fastdecode` rank runs as a child of a small supervisor (this module, no
MPI and no torch): the supervisor forwards signals to the child, and if the child ends
abnormally it prints which rank died and how, then exits with the child's code so the launcher
ends the job.

Signals that arrive before the child has installed its own handlers are held (the child starts
with them blocked) and delivered then, so a stop during start-up is a stop, not a kill.
If the supervisor itself dies (SIGKILL: it forwards every other stop signal), the child ends too,
saying so (the kernel sends it SIGUSR2, PR_SET_PDEATHSIG; a thread that sees its parent change
ends it where the handler cannot run), so no orphaned rank holds the job open. Rows written so
far stay.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ENV_FLAG = "FASTDECODE_SUPERVISED"        # set in the child: the supervisor's pid
PR_SET_PDEATHSIG = 1
ORPHAN_SIGNAL = signal.SIGUSR2            # what the child gets when its supervisor dies
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
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
            signal.signal(sig, signal.SIG_IGN if rank > 0 else
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
    from fastdecode.launch.mpi_env import role_name
    text = (f"fastdecode: rank {rank} ({role_name(rank)} pid {os.getpid()} on {socket.gethostname()}): its "
            f"supervisor (pid {supervisor}) died; ending this rank\n").encode()

    def orphaned(*_) -> None:
        os.write(2, text)
        os._exit(1)

    signal.signal(ORPHAN_SIGNAL, orphaned)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(ORPHAN_SIGNAL), 0, 0, 0)
    threading.Thread(target=_watch_parent, args=(supervisor, orphaned), name="supervisor-watch", daemon=True).start()


def _watch_parent(supervisor: int, orphaned) -> None:
    while os.getppid() == supervisor:
        time.sleep(1.0)
    time.sleep(1.0)                      # the signal's handler speaks first where it can run
    orphaned()
