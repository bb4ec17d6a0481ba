"""generate's streams: `-i -` (stdin) or a pipe as input, `-o -` (stdout) as output.

A job reads its input more than once (to count its lines, to resume, to check a rerun) and
rewrites its output in input order at the end, so a stream is never used in place: an input
stream is copied to a scratch file first, and rows meant for stdout are kept in a scratch file and
written to stdout when the job ends (in input order; a stopped job writes the rows it finished, in
completion order, since nothing would be left to resume from). The run report then goes to
--summary-json, or nowhere. A device that is not a stream (/dev/zero, /dev/null, a terminal as
input) is named as what it is. The shell's names for the standard streams (/dev/stdin,
/dev/stdout, /dev/fd/N) are taken as `-`.
"""
from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile

STDIN_NAMES = ("-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")
STDOUT_NAMES = ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")
_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


# a stream spooled to a scratch file -> the name the job was given ("-" for stdin, a FIFO's path):
# what the output's record names as its input, the same on every rerun (batch/binding.py)
STREAM_INPUTS: dict[str, str] = {}


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
        given = "-" if args.input in STDIN_NAMES else os.path.realpath(args.input)
        args.input = _spool(args.input, os.path.join(scratch, "input.jsonl"))
        STREAM_INPUTS[os.path.realpath(args.input)] = given
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


def _check_input_kind(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return                                 # missing: check_paths says so
    for test, kind in _KINDS:
        if test(mode):
            raise ValueError(f"input {path} is {kind}, not a file: give a JSONL file, or - (stdin) or a pipe")


def _scratch_dir(index_dir: str | None) -> str:
    path = tempfile.mkdtemp(prefix="fastdecode-stream-", dir=index_dir)
    atexit.register(shutil.rmtree, path, True)
    return path


def _spool(source: str, dest: str) -> str:
    """Copy stdin (or a pipe) to `dest` whole; the input is then that file."""
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
    try:
        with open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    finally:
        if close:
            src.close()
    if os.path.getsize(dest) == 0:
        raise ValueError(f"input {source} ({name}) is empty")
    return dest


def write_rows_to_stdout(args) -> None:
    """The scratch output's rows to stdout, as they are in the file (the job has sorted them)."""
    if not os.path.exists(args.output):
        return
    out = sys.stdout.buffer
    try:
        with open(args.output, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
        out.flush()
    except BrokenPipeError:                    # the reader stopped early (`| head`): its choice
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
