"""Files a job replaces or creates beside its output keep the output's permissions: a rewrite
keeps the file's mode and owner (a 600 output stays 600), and side files that hold what the
output holds (rows, generated tokens) are created with the output's mode, never wider.

No side file is written through a symbolic link: a link where one belongs (planted, or left
dangling) would have the job overwrite or create the file it points to, so it is refused
(LinkRefused, naming it). Temporary files get a random name (O_EXCL) beside their file."""
from __future__ import annotations

import errno
import os
import tempfile


class LinkRefused(OSError):
    """A symbolic link stands where the job writes a file of its own."""

    def __init__(self, path: str):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        super().__init__(errno.ELOOP, f"{path} is a symbolic link (to {target}): the job writes this file itself "
                                      f"and never through a link; remove the link")
        self.filename = path

    def __str__(self) -> str:
        return self.strerror


def open_no_link(path: str, flags: int, perm: int = 0o666) -> int:
    """os.open that refuses a symbolic link at `path` (LinkRefused) instead of following it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, perm)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise LinkRefused(path) from None
        raise


def open_like(path: str, like: str | None, mode: str = "wb"):
    """Create (truncate) `path` for writing with the permission bits and owner of `like` (when it
    exists; else as the umask says)."""
    try:
        st = os.stat(like) if like is not None else None
    except FileNotFoundError:
        st = None
    perm = (st.st_mode & 0o7777) if st is not None else 0o666
    fd = open_no_link(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, perm)
    return _as_file(fd, st, mode)


def temp_like(path: str, like: str | None):
    """A new temporary file beside `path`, for replacing it (os.replace): a random name that no
    file or link had (PATH.XXXXXXXX.tmp), with the mode and owner of `like`. -> (file, its path)."""
    try:
        st = os.stat(like) if like is not None else None
    except FileNotFoundError:
        st = None
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path) or ".")
    if st is None:                   # mkstemp makes 0600: as the umask says instead, as open() would
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
    try:
        return _as_file(fd, st, "wb"), tmp
    except BaseException:
        os.unlink(tmp)
        raise


def _as_file(fd: int, st: os.stat_result | None, mode: str):
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


def replace_atomically(path: str, like: str | None, chunks) -> None:
    """Replace `path` by the bytes of `chunks` (an iterable), with the mode of `like`: written to a
    temporary file beside it (temp_like), fsynced and renamed over it; the temporary file is
    removed if anything fails."""
    f, tmp = temp_like(path, like)
    try:
        with f:
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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
