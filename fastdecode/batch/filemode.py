"""Files a job replaces or creates beside its output keep the output's permissions: a rewrite
keeps the file's mode and owner (a 600 output stays 600), and side files that hold what the
output holds (rows, generated tokens) are created with the output's mode, never wider."""
from __future__ import annotations

import os


def open_like(path: str, like: str | None, mode: str = "wb"):
    """Create (truncate) `path` for writing with the permission bits and owner of `like` (when it
    exists; else as the umask says)."""
    try:
        st = os.stat(like) if like is not None else None
    except FileNotFoundError:
        st = None
    perm = (st.st_mode & 0o7777) if st is not None else 0o666
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, perm)
    try:
        if st is not None:
            keep_owner_mode(fd, st)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, mode)


def keep_owner_mode(fd: int, st: os.stat_result) -> None:
    """Give the open file `fd` the mode and (where this process may) the owner in `st`."""
    os.fchmod(fd, st.st_mode & 0o7777)
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
        except PermissionError:       # not root: the owner stays this user's (its group, where it may)
            try:
                os.fchown(fd, -1, st.st_gid)
            except PermissionError:
                pass
        os.fchmod(fd, st.st_mode & 0o7777)     # a chown clears set-id bits


def fsync_dir(path: str) -> None:
    """Make a rename in path's directory durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
