"""generate's files, checked on rank 0 before MPI or the model start: a bad path is a usage
error (exit 2), never found after the run."""
from __future__ import annotations

import os
import stat


def _writable_file_path(path: str, flag: str) -> None:
    """`path` can be created or overwritten as a regular file."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise ValueError(f"{flag} {path} is a directory, expected a file path")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist or is not writable")
    if os.path.exists(real) and not os.access(real, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")


def check_paths(args) -> None:
    if os.path.isdir(args.input):
        raise ValueError(f"input {args.input} is a directory, expected a JSONL file")
    if not os.path.isfile(args.input):
        raise ValueError(f"input file {args.input} not found")
    if os.path.getsize(args.input) == 0:
        raise ValueError(f"input file {args.input} is empty")
    _writable_file_path(args.output, "output")
    real = os.path.realpath(args.output)
    # stat the name, not its realpath: /dev/stderr on a pipe resolves to /proc/PID/fd/pipe:[N], no file
    if os.path.exists(args.output) and not stat.S_ISREG(os.stat(args.output).st_mode):
        raise ValueError(f"output {args.output} is not a regular file ({real}): a job resumes from its output "
                         f"and rewrites it in input order, which a device or pipe cannot do; write to a file, or "
                         f"-o - for rows on stdout")
    if os.path.exists(real) and os.path.samefile(args.input, real):
        raise ValueError(f"output {args.output} is the input file")
    if args.index_dir is not None and not (os.path.isdir(args.index_dir) and os.access(args.index_dir, os.W_OK)):
        raise ValueError(f"--index-dir {args.index_dir} is not a writable directory")
    _writable_file_path(args.summary_json or args.output + ".summary.json", "--summary-json")
    if args.stats_json:
        _writable_file_path(args.stats_json, "--stats-json")
