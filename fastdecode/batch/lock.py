"""One job per output: rank 0 holds an exclusive lock on OUTPUT.lock for the job's life.

The lock is flock(2) on a file beside the output's real path, taken before anything is written;
the kernel releases it when the holder ends, however it ends (SIGKILL, a lost node's NFS lease),
so there is nothing stale to clean up. The holder writes its host, pid and start time into the
file; a second job finds the lock taken and ends at once with exit 2 naming them. On NFS, Linux
takes flock as a byte-range lock the server sees (NFSv4, or v3 with lockd), so jobs on different
nodes exclude each other; GPFS and BeeGFS lock across nodes too; Lustre only when mounted with
`-o flock` (`localflock` excludes jobs on the same node alone). Where the file system refuses
locks the job says so and runs unprotected.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
_held: dict[str, int] = {}      # lock path -> fd, for the life of the process


class OutputBusy(ValueError):
    """Another job holds the output."""


def holder_text(path: str) -> str:
    try:
        with open(path) as f:
            info = json.load(f)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {int(info['pid'])} on host {info['host']} (since {started})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a job that has not written its host and pid yet"


def hold(lock_path: str, what: str) -> bool:
    """Take the lock on `what` (a file the job writes) through lock_path for the life of this
    process; True if held, False where the file system cannot lock (said on stderr). Raises
    OutputBusy naming the holder if another job has it."""
    if lock_path in _held:
        return True
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise OutputBusy(f"{what} is in use by another job: {holder_text(lock_path)}, which holds {lock_path}; "
                             f"wait for it to end, or write to another path") from None
        if e.errno in UNSUPPORTED:
            print(f"fastdecode: warning: cannot lock {lock_path} ({os.strerror(e.errno)}): this file system offers "
                  f"no locks here (Lustre without -o flock, NFS without a lock manager), so nothing stops a second "
                  f"job from writing {what} at the same time", file=sys.stderr, flush=True)
            return False
        raise
    os.set_inheritable(fd, False)
    info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    _held[lock_path] = fd
    return True


def release_all() -> None:
    """Let the locks go (the process ends anyway; for in-process callers)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)
