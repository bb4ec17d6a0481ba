"""generate's files, checked on rank 0 before MPI or the model start: a bad path is a usage
error (exit 2), never found after the run.

Every file the job writes (the output, its side files, the report, the statistics and their
temporary files) must be a file of its own, none of them the input: a flag naming another's
file would have the job destroy it. None of the files the job names after another (side files,
temporary files, locks) may be a symbolic link: the job would write through it to the file it
points to. Then rank 0 takes the output's lock (lock.py; a second job on the same output ends
here) and checks that the output answers this input (binding.py).
"""
from __future__ import annotations

import os
import stat

from fastdecode.batch import binding, lock
from fastdecode.batch.filemode import LinkRefused
from fastdecode.batch.report import default_path
from fastdecode.batch.sidefiles import lock_path, of_output


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


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)          # hard links
    except OSError:
        return False


def written_files(args) -> list[tuple[str, str, str]]:
    """(flag, path, what it is) of every file the job writes."""
    summary = args.summary_json or default_path(args.output)
    files = [("output", args.output, "the output file"), ("--summary-json", summary, "the --summary-json file"),
             ("--summary-json", summary + ".tmp", "the --summary-json file's rewrite")]
    if args.stats_json:
        files += [("--stats-json", args.stats_json, "the --stats-json file"),
                  ("--stats-json", args.stats_json + ".tmp", "the --stats-json file's rewrite")]
    files += [("output", path, what) for what, path in of_output(args.output).items()]
    return files


def check_distinct(args) -> None:
    """No file the job writes is the input or another of its files."""
    files = written_files(args)
    for i, (flag, path, what) in enumerate(files):
        if _same(path, args.input):
            if flag != "output" or what == "the output file":
                raise ValueError(f"{flag} {path} is the input file")
            raise ValueError(f"input {args.input} is {what} ({path}): name the output so that none of its "
                             f"side files is the input")
        for flag2, path2, what2 in files[i + 1:]:
            if (flag, flag2) == ("output", "output") or not _same(path, path2):
                continue
            # name the flag the user gave: the other file is the output's, or the earlier flag's
            user_flag, user_path, other = (flag, path, what2) if flag2 == "output" else (flag2, path2, what)
            raise ValueError(f"{user_flag} {user_path} is {other}: give each file the job writes a path of its own")


def lock_paths(args) -> list[tuple[str, str]]:
    """(lock path, what it guards) of every lock the job takes (hold_outputs)."""
    derived = of_output(args.output).values()
    locks = [(lock_path(args.output), f"output {args.output}")]
    for flag, path in (("--summary-json", args.summary_json), ("--stats-json", args.stats_json)):
        if path and not _same(path, default_path(args.output)) and path not in derived:
            locks.append((os.path.realpath(path) + ".lock", f"{flag} {path}"))
    return locks


def refuse_links(args) -> None:
    """No file the job names after another (side, temporary and lock files) is a symbolic link."""
    named = {args.output, args.summary_json or default_path(args.output), args.stats_json}
    paths = [path for _, path, _ in written_files(args) if path not in named] + [p for p, _ in lock_paths(args)]
    for path in paths:
        if os.path.islink(path):
            raise ValueError(str(LinkRefused(path)))


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
    if args.index_dir is not None and not (os.path.isdir(args.index_dir) and os.access(args.index_dir, os.W_OK)):
        raise ValueError(f"--index-dir {args.index_dir} is not a writable directory")
    _writable_file_path(args.summary_json or default_path(args.output), "--summary-json")
    if args.stats_json:
        _writable_file_path(args.stats_json, "--stats-json")
    check_distinct(args)
    refuse_links(args)


def hold_outputs(args) -> None:
    """Rank 0, after check_paths: lock the output (its side files with it), and --summary-json and
    --stats-json where they lie elsewhere, for the job's life; then refuse an output made from
    another input or made with another model. Raises ValueError (lock.OutputBusy, binding.ForeignOutput)."""
    try:
        for path, what in lock_paths(args):
            lock.hold(path, what)
    except LinkRefused as e:
        raise ValueError(str(e)) from None
    except OSError as e:
        raise ValueError(f"cannot take the lock of output {args.output}: {e}") from None
    try:
        model = binding.job_model(args)
    except OSError as e:
        raise ValueError(f"model {args.model}: cannot be read: {e}") from None
    binding.check(args.output, args.input, args.overwrite, model)
