"""One job per output: rank 0 holds an exclusive lock on OUTPUT.lock for the job's life.

The lock is flock(2) on a file beside the output's real path, taken before anything is written;
the kernel releases it when the holder ends, however it ends (SIGKILL, a lost node's NFS lease),
so a file a killed job left is no obstacle. The holder writes its host, pid and start time into
the file; a second job finds the lock taken and ends at once with exit 2 naming them. The lock is
the open descriptor, so the holder removes the file as it exits (a job that takes a lock checks
that the file it locked is still the one at the path, or it could hold a removed file's lock).
The file is opened without following a symbolic link: a link in its place is refused, never
written through. On NFS, Linux
takes flock as a byte-range lock the server sees (NFSv4, or v3 with lockd), so jobs on different
nodes exclude each other; GPFS and BeeGFS lock across nodes too; Lustre only when mounted with
`-o flock` (`localflock` excludes jobs on the same node alone). Where the file system refuses
locks the job says so and runs unprotected.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time

from fastdecode.batch.filemode import open_no_link

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
    OutputBusy naming the holder if another job has it; LinkRefused if lock_path is a link."""
    if lock_path in _held:
        return True
    while True:
        fd = open_no_link(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise OutputBusy(f"{what} is in use by another job: {holder_text(lock_path)}, which holds "
                                 f"{lock_path}; wait for it to end, or write to another path") from None
            if e.errno in UNSUPPORTED:
                print(f"fastdecode: warning: cannot lock {lock_path} ({os.strerror(e.errno)}): this file system "
                      f"offers no locks here (Lustre without -o flock, NFS without a lock manager), so nothing "
                      f"stops a second job from writing {what} at the same time", file=sys.stderr, flush=True)
                return False
            raise
        if _is_at(fd, lock_path):
            break
        os.close(fd)            # its holder removed it as we opened it: lock the file now at the path
    os.set_inheritable(fd, False)
    info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    _held[lock_path] = fd
    return True


def _is_at(fd: int, path: str) -> bool:
    """Whether the open file `fd` is the file at `path` now."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def release_all() -> None:
    """Remove the lock files and let the locks go (at exit, and for in-process callers): the file
    is removed while still locked, so no other job ever sees it unlocked and stale."""
    while _held:
        path, fd = _held.popitem()
        try:
            if _is_at(fd, path):
                os.unlink(path)
        except OSError:
            pass                # a directory gone or read-only: the lock still goes with the descriptor
        os.close(fd)


atexit.register(release_all)


def remove_if_unheld(path: str, remove, flags: int = os.O_RDONLY) -> bool:
    """remove(path) unless a running job holds `path` locked (flock; the scratch files and
    directories a killed job left behind are not held); -> whether it was removed."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        remove(path)
        return True
    except OSError:
        return False                     # held by a running job, or already gone
    finally:
        os.close(fd)
