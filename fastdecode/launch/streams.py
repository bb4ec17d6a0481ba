"""stdout and stderr as a launcher forwards them: whole lines, and stderr ahead of the last stdout line.

Under mpirun every rank's stdout and stderr are pipes the launcher reads separately and copies to
its own. A line written in two pieces (Python writes the text and its newline apart when the
streams are unbuffered, as PYTHONUNBUFFERED makes them) can be spliced with another rank's or
stream's line between the pieces; and stderr lines written just before a stdout line may reach
the terminal after it. So every line goes out in one write, and before the run's last stdout line
(`Throughput:`) rank 0 waits, briefly, until the launcher has read its stderr.
"""
from __future__ import annotations

import fcntl
import os
import stat
import struct
import sys
import termios
import time

DRAIN_WAIT_S = 2.0          # at most this long for the launcher to read stderr
FORWARD_GRACE_S = 0.05      # and this long for it to copy what it read


def whole_lines() -> None:
    """Write stdout and stderr a line at a time, each line in one write() (not unbuffered pieces)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):     # replaced by something that is not a TextIOWrapper
            pass


def _pending_bytes(fd: int) -> int | None:
    """Bytes written to the pipe `fd` and not read yet; None if `fd` is not a pipe."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return None


def drain_stderr(wait_s: float = DRAIN_WAIT_S) -> None:
    """Flush stderr and, where it is a pipe other than stdout's, wait until its reader has read it."""
    sys.stderr.flush()
    try:
        err, out = os.fstat(2), os.fstat(1)
    except OSError:
        return
    if (err.st_dev, err.st_ino) == (out.st_dev, out.st_ino):      # one pipe: its order is kept
        return
    pending = _pending_bytes(2)
    if pending is None:                   # a terminal or a file: written in order already
        return
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.005)
        pending = _pending_bytes(2)
    time.sleep(FORWARD_GRACE_S)
