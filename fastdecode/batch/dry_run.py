"""`fastdecode generate --dry-run`: the checks a job makes at its start, made now, without MPI,
weights or a GPU. The SLURM scripts' --dry-run calls it before a job waits in the queue, so a
missing model, input or output directory is found in seconds, not after the wait.

Checked as generate checks them, with generate's messages (exit 2): the files (the input exists
and is a non-empty file, every file the job writes can be written and is none of the input's),
the model (found: a directory, a .gguf, an embedded name, or an HF repo id in the local cache;
its config servable with the flags given), and the output (empty, or made from this input).
Then every input line is parsed as the job would parse it: lines that would become error rows
are counted and the first named; an input with no line the job can serve exits 2. Not checked
here: the output's lock (a job on it now may end before this one starts), and the ranks' own
machines (memory, kernels), which the job checks on each rank at its start.
"""
from __future__ import annotations

from fastdecode.batch import binding
from fastdecode.batch.paths import check_paths
from fastdecode.batch.stdio import STDIN_NAMES, STDOUT_NAMES


def check_job(args, check_model) -> list[str]:
    """What the job would find at its start, as lines to print; raises ValueError or the CLI's
    UsageError (from check_model, the CLI's check of the model) with the job's message."""
    _check_streams(args)
    check_paths(args)
    bad = [n for n in args.served_model_name or () if not n.strip()]
    if bad:
        raise ValueError(f"--served-model-name: a name must be non-empty, got {bad[0]!r}")
    # the job's ranks are not launched yet: the S-workers' split is checked, not the launch's size
    groups = getattr(args, "data_parallel_size", 1)
    check_model(args, world=args.tensor_parallel_size * groups)
    binding.check(args.output, args.input, args.overwrite)
    lines = _check_lines(args)
    found = [f"dry run: model {args.model}: found and servable", f"dry run: input {args.input}: {lines}",
             f"dry run: output {args.output}: {_output_state(args)}"]
    if groups > 1:
        found.append(f"dry run: {groups} data-parallel groups: {groups_layout(groups, args.tensor_parallel_size)}")
    return found


def groups_layout(groups: int, s_ranks: int) -> str:
    """Where a job's groups' ranks go, in words (launch/ranks.Roles)."""
    heads = groups * s_ranks
    each = "S-worker" if s_ranks == 1 else f"S-worker of {s_ranks} ranks"
    return (f"ranks 0..{heads - 1} are the {groups} groups' S-workers (group g: "
            f"{'rank g' if s_ranks == 1 else f'ranks {s_ranks}g..{s_ranks}g+{s_ranks - 1}'}, one {each} each), the "
            f"ranks from {heads} on their R-workers in {groups} contiguous blocks (block g: group g's); rank 0 "
            f"deals the input and writes the output")


def _check_streams(args) -> None:
    """A stream is read once, by the job: a dry run cannot look at it without taking it."""
    if args.input in STDIN_NAMES or args.output in STDOUT_NAMES:
        raise ValueError("--dry-run checks files: -i and -o must name files (a stream would be used up by the check)")


def _check_lines(args) -> str:
    """Parse every line as the job will; ValueError if none would be served."""
    from fastdecode.batch.jsonl import read_lines
    from fastdecode.batch.schema import limits_from
    from fastdecode.model.names import served_model
    from fastdecode.model.source import resolve_model
    served = served_model(resolve_model(args.model, args.revision), args.served_model_name)
    total = errors = 0
    first = None
    for line in read_lines(args.input, limits_from(args), served):
        total += 1
        if line.error is not None:
            errors += 1
            text = str(line.error)
            first = first or (text if text.startswith("line ") else f"line {line.line_no}: {text}")
    if total == 0:
        raise ValueError(f"input file {args.input} holds no request lines (only blank lines)")
    if errors == total:
        raise ValueError(f"input file {args.input}: none of its {total} lines is a request the job can serve; "
                         f"each would be an error row ({first})")
    if errors:
        rows = "1 would be an error row" if errors == 1 else f"{errors} would be error rows"
        return f"{total} request lines; {rows} (the first: {first})"
    return f"{total} request lines, each parses"


def _output_state(args) -> str:
    if args.overwrite:
        return "--overwrite: the job starts over"
    if binding.has_rows(binding.real(args.output)):
        return "holds rows of this input: the job resumes from it"
    return "new or empty: the job starts from the first line"
