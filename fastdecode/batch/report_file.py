"""The run report as a file: written whole through a temporary file (its mode and owner kept),
with a spare temporary file kept while a run is live so that a full disk still takes the
report's last write, and failed by rank 0's supervisor when rank 0 died. Imports nothing of the
launch package: the supervisor writes through it."""
from __future__ import annotations

import errno
import json
import os

from fastdecode.batch.filemode import keep_owner_mode, open_like, open_no_link

SPARE_BYTES = 512 << 10  # allocated for the report's next write while a run is live (a full disk): a
                         # hundred runs' figures in its history and 64 R-workers' load take about 200 KiB
FULL = (errno.ENOSPC, errno.EDQUOT)


def encode(obj: dict) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


def write_atomic(path: str, obj: dict | bytes) -> None:
    """Replace the report at `path` (its mode and owner kept), through a temporary file: the spare
    one if reserve() made it. On a full disk without a spare it is rewritten in place."""
    data = obj if isinstance(obj, bytes) else encode(obj)
    tmp = path + ".tmp"
    try:
        _write_tmp(tmp, path, data)
        os.replace(tmp, path)
    except OSError as e:
        if e.errno not in FULL or not os.path.exists(path):
            raise
        _discard(tmp)
        with open(path, "r+b") as f:       # its blocks are allocated: it may still fit in them
            f.write(data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())


def write_stats(path: str, document: dict) -> None:
    """--stats-json: replace `path` atomically, keeping an existing file's mode and owner."""
    tmp = path + ".tmp"
    with open_like(tmp, path, "w") as f:
        json.dump(document, f)
    os.replace(tmp, path)


def _write_tmp(tmp: str, like: str, data: bytes) -> None:
    try:
        fd = open_no_link(tmp, os.O_WRONLY)      # the spare: its blocks are there whatever the disk holds
    except FileNotFoundError:
        fd = None
    if fd is not None and os.path.exists(like):
        keep_owner_mode(fd, os.stat(like))
    with open_like(tmp, like) if fd is None else os.fdopen(fd, "wb") as f:
        f.write(data)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def _discard(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def reserve(path: str) -> None:
    """Allocate the spare temporary file of the report at `path` (best effort)."""
    tmp = path + ".tmp"
    try:
        fd = open_no_link(tmp, os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, SPARE_BYTES)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def release_spare(path: str) -> None:
    _discard(path + ".tmp")


def mark_file_failed(path: str, error: str, exit_code: int | None, since: float) -> bool:
    """Rank 0's supervisor, after rank 0 ended abnormally: fail the report that run left "running"
    (written since `since`, a time.time())."""
    try:
        if os.path.getmtime(path) < since:
            return False
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(report, dict) or report.get("state") != "running":
        return False
    report.update(state="failed", interrupted=False, error=error, exit_code=exit_code, failed_rank=0)
    write_atomic(path, report)
    return True
