"""Name a rank that dies.

A process killed by the OOM killer, a segfault or `kill -9` cannot say who it was, and MPI
launchers report the processes they clean up afterwards, not the one that died first. So under
an MPI launcher each `fastdecode` rank runs as a child of a small supervisor (this module, no
MPI and no torch): the supervisor forwards signals to the child, and if the child ends
abnormally it prints which rank died and how, then exits with the child's code so the launcher
ends the job.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

ENV_FLAG = "FASTDECODE_SUPERVISED"
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
CLEAN_EXITS = (0, 2, 75)      # done, usage error, interrupted with work saved


def should_supervise() -> bool:
    from fastdecode.launch.mpi_env import launched_size
    return launched_size() > 1 and os.environ.get(ENV_FLAG) != "1" and \
        os.environ.get("FASTDECODE_NO_SUPERVISOR") != "1"


def run_supervised(argv: list[str]) -> int:
    from fastdecode.launch.mpi_env import launched_rank, role_name
    env = dict(os.environ, **{ENV_FLAG: "1"})
    # close_fds=False: the launcher's PMI connection (PMI_FD) must reach the child
    child = subprocess.Popen([sys.executable, "-m", "fastdecode"] + argv, env=env, close_fds=False)
    rank = launched_rank()
    for sig in FORWARDED:       # R-workers ignore stop signals (rank 0 shuts them down)
        signal.signal(sig, signal.SIG_IGN if rank > 0 and sig != signal.SIGUSR2 else
                      (lambda signum, _frame: child.send_signal(signum)))
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:
            continue
    if code in CLEAN_EXITS or code == 1:     # 1: the child reported its own failure already
        return code
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    print(f"fastdecode: rank {rank} ({role_name(rank)} pid {child.pid} on {socket.gethostname()}) died: {how}",
          file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code
