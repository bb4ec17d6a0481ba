"""generate's streams: `-i -` (stdin) or a pipe as input, `-o -` (stdout) as output.

A job reads its input more than once (to count its lines, to resume, to check a rerun) and
rewrites its output in input order at the end, so a stream is never used in place: an input
stream is copied to a scratch file first, and rows meant for stdout are kept in a scratch file and
written to stdout when the job ends (in input order; a stopped job writes the rows it finished, in
completion order, since nothing would be left to resume from). The run report then goes to
--summary-json, or nowhere. A device that is not a stream (/dev/zero, /dev/null, a terminal as
input) is named as what it is. The shell's names for the standard streams (/dev/stdin,
/dev/stdout, /dev/fd/N) are taken as `-`.

An output is bound to its input (binding.py) by the input's name: for stdin `-`, for a named
FIFO its path; an anonymous pipe (`-i <(zcat in.jsonl.gz)`, /proc/PID/fd/pipe:[N]) has no name
that outlives the job, so it is bound to the SHA-256 of what it delivered: the same command
with the same stream resumes. The scratch directory is held locked (flock) while its job runs;
one a killed job left (unlocked, older than a minute) is removed by the next job that makes one
in the same directory. Rows for stdout whose reader went away are counted and said: the job
then exits 1.
"""
from __future__ import annotations

import atexit
import fcntl
import glob
import hashlib
import os
import shutil
import stat
import sys
import tempfile
import time

from fastdecode.batch.lock import remove_if_unheld

STDIN_NAMES = ("-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")
STDOUT_NAMES = ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")
_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


# a stream spooled to a scratch file -> the name the job was given ("-" for stdin, a FIFO's path):
# what the output's record names as its input, the same on every rerun (batch/binding.py)
STREAM_INPUTS: dict[str, str] = {}
SCRATCH_PREFIX = "fastdecode-stream-"
STALE_S = 60.0            # a scratch directory unlocked for this long was left by a job that ended
_scratch_held: list[int] = []      # descriptors of this process's scratch directories, locked


def input_identity(path: str) -> str:
    """The input an output is bound to: its real path, or the stream it was spooled from."""
    real = os.path.realpath(path)
    return STREAM_INPUTS.get(real, real)


def rows_to_stdout(output: str) -> bool:
    return output in STDOUT_NAMES


def summary_path(args) -> str | None:
    """Where the run report goes: --summary-json, else beside the output; none for rows on stdout."""
    from fastdecode.batch.report import default_path
    if args.summary_json:
        return args.summary_json
    return None if rows_to_stdout(args.output) else default_path(args.output)


def take_streams(args) -> None:
    """Rank 0, before the paths are checked: a stream as input becomes a scratch copy, `-o -` a
    scratch output (args.rows_to_stdout set); ValueError naming an input that is neither a file
    nor a stream. The scratch files go when the process ends."""
    args.rows_to_stdout = False
    scratch = None
    if args.input in STDIN_NAMES or _is_pipe(args.input):
        scratch = _scratch_dir(args.index_dir)
        given = "-" if args.input in STDIN_NAMES else _pipe_name(args.input)
        args.input, digest = _spool(args.input, os.path.join(scratch, "input.jsonl"))
        STREAM_INPUTS[os.path.realpath(args.input)] = given or f"an anonymous pipe of sha256 {digest}"
    else:
        _check_input_kind(args.input)
    if rows_to_stdout(args.output):
        scratch = scratch or _scratch_dir(args.index_dir)
        args.rows_to_stdout = True
        args.output = os.path.join(scratch, "output.jsonl")
        args.overwrite = True                  # nothing to resume from: earlier rows went to stdout
        if args.summary_json is None:          # the report stays in the scratch directory: none
            args.summary_json = os.path.join(scratch, "output.jsonl.summary.json")


def _is_pipe(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _pipe_name(path: str) -> str | None:
    """A FIFO's real path; None for an anonymous pipe (its /proc name is gone with its job)."""
    real = os.path.realpath(path)
    try:
        return real if os.path.samefile(real, path) else None
    except OSError:
        return None


def _check_input_kind(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return                                 # missing: check_paths says so
    for test, kind in _KINDS:
        if test(mode):
            raise ValueError(f"input {path} is {kind}, not a file: give a JSONL file, or - (stdin) or a pipe")


def _scratch_dir(index_dir: str | None) -> str:
    parent = index_dir or tempfile.gettempdir()
    reclaim_scratch(parent)
    path = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=parent)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass                                   # a file system without locks: it is still removed at exit
    _scratch_held.append(fd)
    atexit.register(shutil.rmtree, path, True)
    return path


def reclaim_scratch(parent: str, now: float | None = None) -> int:
    """Remove the scratch directories in `parent` that no job holds (left by a killed job); -> how many."""
    now = time.time() if now is None else now
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(parent), SCRATCH_PREFIX + "*")):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or now - st.st_mtime < STALE_S:
            continue                           # not ours, or just made: its job may not hold it yet
        removed += remove_if_unheld(path, shutil.rmtree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    return removed


def _spool(source: str, dest: str) -> tuple[str, str]:
    """Copy stdin (or a pipe) to `dest` whole; the input is then that file. -> (dest, the SHA-256
    of the content)."""
    name = "stdin" if source in STDIN_NAMES else source
    if source in STDIN_NAMES:
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("input - is a terminal: pipe the JSONL in (fastdecode generate -i - < in.jsonl), or "
                             "give a file")
        src = sys.stdin.buffer
        close = False
    else:
        src = open(source, "rb")
        close = True
    digest = hashlib.sha256()
    try:
        with open(dest, "wb") as out:
            while block := src.read(1 << 20):
                digest.update(block)
                out.write(block)
    finally:
        if close:
            src.close()
    if os.path.getsize(dest) == 0:
        raise ValueError(f"input {source} ({name}) is empty")
    return dest, digest.hexdigest()


def write_rows_to_stdout(args) -> int:
    """The scratch output's rows to stdout, as they are in the file (the job has sorted them);
    -> how many rows did not reach it (its reader went away: `| head`), said on stderr."""
    if not os.path.exists(args.output):
        return 0
    sys.stdout.flush()
    fd = sys.stdout.fileno()
    with open(args.output, "rb") as f:
        sent = 0
        try:
            while block := f.read(1 << 20):
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
                sent += block.count(b"\n")
        except BrokenPipeError:
            sent += bytes(block[:len(block) - len(view)]).count(b"\n")
            undelivered = bytes(view).count(b"\n") + sum(b.count(b"\n") for b in iter(lambda: f.read(1 << 20), b""))
        else:
            return 0
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)     # nothing more may reach the closed pipe
    print(f"fastdecode: stdout was closed by its reader: {undelivered} of {sent + undelivered} rows not delivered",
          file=sys.stderr, flush=True)
    return undelivered


def deliver_rows(args, report: dict, code: int) -> int:
    """-o -: the rows to stdout at the job's end; -> the job's exit code: 1 instead of 0 where
    rows did not reach the reader (the run report, if one is written, then says "failed")."""
    undelivered = write_rows_to_stdout(args)
    if not undelivered or code != 0:
        return code
    if args.summary_json and report.get("state") == "done":
        from fastdecode.batch.report_file import write_atomic
        report.update(state="failed", exit_code=1, error=f"{undelivered} row(s) not delivered: stdout was closed "
                                                         f"by its reader")
        write_atomic(args.summary_json, report)
    return 1
