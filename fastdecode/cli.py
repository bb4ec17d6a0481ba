"""The `fastdecode` command: generate | profile | plan | simulate | report | info.

Every rank of `mpirun -n 1+R fastdecode generate ...` runs this: rank 0 becomes the S-worker,
ranks 1..R R-workers (which never import torch). Usage and config errors are found on rank 0
before any compute and end every rank with exit code 2; failures end the whole job with exit 1
and a message naming the rank.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from fastdecode.engine_options import (  # noqa: F401  (the argument types: imported from here too)
    add_engine_options,
    add_generate_engine_options,
    bytes_arg,
    engine_args,
    positive_float,
    positive_int,
)
from fastdecode.flag_ranges import MIN_PROGRESS_S, duration, machine_error
from fastdecode.launch import mpi_env

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    from fastdecode import __version__
    from fastdecode.cli_args import CommandParser
    parser = CommandParser(prog="fastdecode", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"fastdecode {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{generate,profile,plan,simulate,report,info}")
    sub.required = True
    g = sub.add_parser("generate", help="batch generation: OpenAI batch JSONL in, JSONL out",
                       description="Batch generation. Under mpirun -n 1+R: rank 0 S-worker, 1..R R-workers.")
    # --input-file / --output-file: vllm run-batch's names
    g.add_argument("-i", "--input", "--input-file", dest="input", required=True,
                   help="OpenAI batch JSONL file of requests")
    g.add_argument("-o", "--output", "--output-file", dest="output", required=True,
                   help="JSONL file of results (one line per input line)")
    add_engine_options(g)
    g.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                   help="names the requests' body.model may give the model (vLLM's flag; several, or the flag "
                        "repeated); the first is the model named in every response. Requests may always name "
                        "-m as given, or no model; any other name gets a 404 model_not_found row")
    add_generate_engine_options(g)
    from fastdecode.engine_options import add_data_parallel_size
    add_data_parallel_size(g)
    g.add_argument("--sort-output", dest="sort_output", action=argparse.BooleanOptionalAction, default=True,
                   help="when the input is done, rewrite the output in input order, lines of earlier runs "
                        "included (default); --no-sort-output keeps completion order")
    g.add_argument("--overwrite", action="store_true",
                   help="start over: empty an existing output file (default: resume, skipping the lines it "
                        "already answers)")
    g.add_argument("--save-kv-on-stop", choices=["auto", "never", "always"], default="auto",
                   help="on a stop, also save the running sequences' KV-cache beside the output (OUTPUT.inflight.kv) "
                        "so the rerun reloads it instead of recomputing it: auto where it takes at most half the "
                        "free space there (default), always where it fits, never")
    g.add_argument("--summary-json", default=None,
                   help="run report: throughput, token latency, R-worker load, errors by code, runs "
                        "(default: OUTPUT.summary.json)")
    g.add_argument("--index-dir", default=None,
                   help="directory for the scratch index of custom_ids while resuming/deduplicating "
                        "(default: $TMPDIR or /tmp; node-local disk is best)")
    g.add_argument("--stats-json", default=None, help="write per-step statistics and a summary here")
    g.add_argument("--dry-run", action="store_true",
                   help="check the model, the input's lines and the files as the job would, say what was found, "
                        "and exit (0, or 2 with the job's error); loads no weights, starts no ranks")
    g.add_argument("--quiet", action="store_true",
                   help="no progress lines and no R-worker roster at start-up (results, warnings and errors "
                        "still print)")
    g.add_argument("--progress-interval", type=duration(MIN_PROGRESS_S), default=None, metavar="SECONDS",
                   help="seconds between progress lines when stderr is not a terminal (default "
                        "$FASTDECODE_PROGRESS_INTERVAL, else 10); on a terminal a bar")
    from fastdecode.batch.schema import add_limit_options
    add_limit_options(g)
    from fastdecode.sizing.profile_cli import add_parser as add_profile_parser
    add_profile_parser(sub, add_engine_options)
    from fastdecode.sizing.plan import add_parser as add_plan_parser
    add_plan_parser(sub)
    from fastdecode.sim.cli import add_parser as add_simulate_parser
    add_simulate_parser(sub)
    from fastdecode.batch.report_cmd import add_parser as add_report_parser
    add_report_parser(sub)
    info = sub.add_parser("info", help="versions, ISA path, MPI, devices; with --model, what it serves of a model")
    info.add_argument("--model", "-m", default=None,
                      help="also name this model's architecture, shape and attention variants (its config, checked "
                           "against the weights' shapes: no tensor is read); an unsupported or malformed model exits 2 "
                           "with the reason")
    info.add_argument("--revision", default=None, help="--model's revision, as generate's")
    return parser


# ---------------------------------------------------------------------------- validation (no MPI, no torch)

def validate_generate(args) -> None:
    from fastdecode.batch.paths import check_paths, hold_outputs
    from fastdecode.batch.progress import interval_from
    from fastdecode.batch.stdio import take_streams
    try:
        take_streams(args)                   # -i -, a pipe, -o -: scratch files in their place
        check_paths(args)
        if not args.quiet:
            interval_from(args.progress_interval)
    except ValueError as e:
        raise UsageError(str(e)) from None
    bad = [n for n in args.served_model_name or () if not n.strip()]
    if bad:
        raise UsageError(f"--served-model-name: a name must be non-empty, got {bad[0]!r}")
    check_model(args)
    try:
        hold_outputs(args)            # last: the job owns its output from here to its end
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_model(args, world: int | None = None) -> None:
    """vLLM's flags are ones fastdecode serves, the model's config (and a --tokenizer) is readable
    and servable, --max-model-len fits it, and a chunked-prefill budget holds --max-batch decode rows.
    world: the job's MPI ranks (default: as launched)."""
    from fastdecode.engine.args import check_batch_budget, default_max_batch, resolve_device
    from fastdecode.model.config import ConfigError
    from fastdecode.model.quantization import weight_format
    from fastdecode.model.source import read_config, resolve_model
    from fastdecode.tp.checks import usage_error
    from fastdecode.vllm_args import check_flags
    refused = check_flags(args)
    if refused:
        raise UsageError(refused)
    try:
        source = resolve_model(args.model, args.revision)
        config = read_config(source)
        config.resolve_max_model_len(getattr(args, "max_model_len", None))
        weight_format(getattr(args, "quantization", None), source)     # an fp8 checkpoint's scales, too
        from fastdecode.launch.groups import group_error
        world = world or mpi_env.launched_size()
        groups = getattr(args, "data_parallel_size", 1)
        tp_error = group_error(groups, args.tensor_parallel_size, world) or \
            usage_error(args.tensor_parallel_size, config, args.device, world // groups)
        if tp_error:
            raise ConfigError(tp_error)
        if args.tokenizer:
            resolve_model(args.tokenizer, args.tokenizer_revision)
        elif args.tokenizer_revision:
            raise ConfigError("--tokenizer-revision needs --tokenizer (the model's own tokenizer follows --revision)")
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a model file that breaks a reader is a bad model file
        raise UsageError(f"model {args.model}: cannot be read: {one_line(e)}") from None
    budget = getattr(args, "max_num_batched_tokens", None)
    try:
        if budget is not None:
            check_batch_budget(budget, args.max_batch or default_max_batch(resolve_device(args.device)))
    except ValueError as e:
        raise UsageError(str(e).replace("max_num_batched_tokens", "--max-num-batched-tokens")
                         .replace("max_batch", "--max-batch")) from None


def agree_on_usage(comm, error: str | None) -> bool:
    """Collective: every rank's verdict (rank 0: the command line and its environment; the others:
    their environment) reaches rank 0, which prints each distinct error once; True (all exit 2) if
    any rank has one."""
    errors = comm.allgather(error)
    if not any(errors):
        return False
    if comm.Get_rank() == 0:
        for text in dict.fromkeys(e for e in errors if e):          # distinct, in rank order
            ranks = [r for r, e in enumerate(errors) if e == text]
            who = "" if 0 in ranks else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
            print(f"fastdecode: error: {who}{text}", file=sys.stderr, flush=True)
    return True


# ---------------------------------------------------------------------------- commands

def run_job(args, validate, s_worker_main) -> int:
    """The rank logic shared by generate and profile: check the environment on every rank and the
    command line on rank 0, agree, split roles (and data-parallel groups: launch/groups.py)."""
    from fastdecode.launch.env_vars import environment_error
    from fastdecode.launch.ranks import launched_roles
    rank, size = mpi_env.launched_rank(), mpi_env.launched_size()
    roles = launched_roles(getattr(args, "tensor_parallel_size", 1), getattr(args, "data_parallel_size", 1))
    error = environment_error(runs_kernels=roles.holds_kv(rank)) or machine_error(args, rank, roles)
    if rank == 0 and error is None:
        error = validation_error(args, validate)      # (it loads torch: the model's config is checked)
    elif error is None and rank in roles.leaders():
        import importlib           # another group's S-worker loads torch as rank 0 does, not after it
        importlib.import_module("fastdecode.tp.engines")
    if size <= 1 and error:                              # a singleton: stop before MPI starts
        print(f"fastdecode: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if size == 1 and mpi_env.under_launcher() and not getattr(args, "quiet", False):
        print("fastdecode: one MPI rank: local mode, the R-part runs in this process (no R-workers); launch 1+R "
              "ranks for R R-workers (mpirun -n 3: two)", file=sys.stderr, flush=True)
    comm = world = mpi_env.world(args.timeout)
    try:   # from here a failure anywhere before the first step ends every rank at once (an abort)
        leaders = None
        if comm is not None:
            if agree_on_usage(comm, error):
                return EXIT_USAGE
            rank0_address = mpi_env.share_end_notices(comm)      # a rank that fails or dies is reported
            from fastdecode.launch import groups
            group = groups.split(comm, roles)
            inner, at = roles.local(comm.Get_rank())
            if inner.is_rworker(at):
                from rworker.worker import run
                return run(group.comm, args.r_threads, args.rworker_mem, args.timeout, end_notice_to=rank0_address,
                           s_ranks=roles.s_ranks)
            if at != 0:                                          # the tensor-parallel S-worker's other ranks
                from fastdecode.tp.follower_engine import run_follower
                return run_follower(engine_args(args), group.comm, end_notice_to=rank0_address)
            if group.index > 0:                                  # another data-parallel group's S-worker
                from fastdecode.batch.group_runner import run_group
                return run_group(args, group.comm, group.leaders)
            comm, leaders = group.comm, group.leaders
        elif error:
            print(f"fastdecode: error: {error}", file=sys.stderr)
            return EXIT_USAGE
        return s_worker_main(args, comm, leaders) if leaders is not None else s_worker_main(args, comm)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - must end the MPI job, not hang it
        mpi_env.fail(world, e)                  # every group's ranks end
        return EXIT_FAILURE

def validation_error(args, validate) -> str | None:
    """Rank 0's check of the command line and its inputs, as one line (None: all is well). Any
    exception counts, not only the checks' own: the other ranks learn of it at MPI's start-up
    (agree_on_usage) and end with exit 2 with rank 0, instead of waiting for a rank 0 that is gone."""
    try:
        validate(args)
    except UsageError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - an input that breaks a parser is still a bad input
        return f"checking the inputs (-m {args.model}): {one_line(e)}"
    return None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as `Type: message` on one line of at most `limit` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cmd_generate(args) -> int:
    return run_job(args, validate_generate, run_s_worker)


def cmd_dry_run(args) -> int:
    """generate --dry-run: the job's start-up checks alone (batch/dry_run.py); 0, or 2 and why."""
    from fastdecode.batch.dry_run import check_job
    try:
        found = check_job(args, check_model)
    except (UsageError, ValueError) as e:
        print(f"fastdecode: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print("\n".join(found), flush=True)
    return EXIT_OK


def run_s_worker(args, comm, leaders=None) -> int:
    """Rank 0: resume from the output, serve, and on SIGUSR1/SIGTERM/SIGINT stop after the step in
    flight, save (rows done, generation in flight), shut the R-workers down and exit 75 (the SLURM
    scripts requeue on it). leaders: the data-parallel groups' S-workers, whose dealer this rank is."""
    from fastdecode.batch.generate import print_report, run_generate
    from fastdecode.batch.interrupt import STOP

    # installed as the process started and kept to the exit: a signal at any point is a clean
    # stop, never the default action (which would end rank 0 without a report)
    stop = STOP.install()
    engines = []
    dealer = None
    if leaders is not None:
        from fastdecode.batch.dealer import Dealer
        from fastdecode.launch.ranks import launched_roles
        dealer = Dealer(leaders, args.timeout)
        if not args.quiet:
            print(f"fastdecode: {args.data_parallel_size} data-parallel groups ({launched_roles().describe_groups()}); "
                  f"rank 0 deals the input to them as their queues run low and writes the one output",
                  file=sys.stderr, flush=True)

    def make_engine():
        from fastdecode.tp.engines import s_worker_engine
        if dealer is not None:
            dealer.start(serve=True)              # the other groups load their engines meanwhile
        engines.append(s_worker_engine(engine_args(args), comm))
        return engines[0]

    def skip_engine():
        if dealer is not None:
            dealer.start(serve=False)
        from fastdecode.tp.steps import stop_group
        stop_group(comm, args.tensor_parallel_size)

    # the output is read before the model loads: a rerun that finds every line answered makes no
    # engine, and the R-workers end before their start-up (and kernel tune)
    summary, rep, code = run_generate(make_engine, args, stop, skip_engine=skip_engine, dealer=dealer)
    rows_to_stdout = getattr(args, "rows_to_stdout", False)     # set by validate_generate (batch/stdio.py)
    if rows_to_stdout:                         # -o -: stdout holds the rows, the report goes to stderr
        from fastdecode.batch.stdio import deliver_rows
        code = deliver_rows(args, rep, code)   # 1 where stdout's reader went away before every row
        if code == mpi_env.EXIT_TEMPFAIL:
            print("fastdecode: with -o - a stopped job has nothing to resume from: the rows it finished are on "
                  "stdout; give -o FILE to resume", file=sys.stderr, flush=True)
    if summary is not None:
        print_report(summary, rep, rows_on_stdout=rows_to_stdout)
    return code                          # the report's exit_code: its state says the same


def validate_model(args) -> None:
    check_model(args)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise UsageError(f"output {args.output}: directory {out_dir} does not exist or is not writable")


def validate_profile(args) -> None:
    if args.tensor_parallel_size > 1:
        raise UsageError(f"fastdecode profile measures one S-rank, not --tensor-parallel-size "
                         f"{args.tensor_parallel_size}: profile with 1 and give the profile to `fastdecode plan "
                         f"--tensor-parallel-size {args.tensor_parallel_size}`, which splits its S-part and adds "
                         f"the collectives over --tp-link-gbps")
    validate_model(args)


def cmd_profile(args) -> int:
    from fastdecode.sizing.profile_cli import run_s_worker
    return run_job(args, validate_profile, run_s_worker)


def cmd_plan(args) -> int:
    from fastdecode.sizing.plan import run
    return run(args)


def cmd_simulate(args) -> int:
    from fastdecode.sim.cli import run
    return run(args)


def cmd_report(args) -> int:
    from fastdecode.batch.report_cmd import run
    return run(args)


def cmd_info(args) -> int:
    from fastdecode.launch.info import collect, model_info, render
    from fastdecode.model.config import ConfigError
    info = collect()
    if args.model:
        try:
            info.update(model_info(args.model, args.revision))
        except Exception as e:  # noqa: BLE001 - as generate's check of the model: a usage error
            print(render(info))
            why = str(e) if isinstance(e, ConfigError) else f"model {args.model}: cannot be read: {one_line(e)}"
            print(f"fastdecode info: error: {why}", file=sys.stderr)
            return EXIT_USAGE
    print(render(info))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from fastdecode.launch.streams import whole_lines
    whole_lines()                             # every rank: a line is one write, never spliced by a launcher
    words = sys.argv[1:] if argv is None else argv
    job = next((w for w in words if not w.startswith("-")), None) in ("generate", "profile")
    try:
        return run_command(argv, words, job)
    finally:
        if job and argv is None:      # the process ends: the work is saved or reported, and Python's
            # exit would give a late stop signal its default action (death, a launcher's error code)
            signal.pthread_sigmask(signal.SIG_BLOCK, mpi_env.STOP_SIGNALS)


def run_command(argv: list[str] | None, words: list[str], job: bool) -> int:
    rank = mpi_env.launched_rank()
    if job:
        take_stop_signals(rank)               # first, before the slow imports of the parser
        from fastdecode.launch import supervise
        supervise.child_started(rank)         # (a supervised child: its held signals come in now)
    parser = build_parser()
    args = parser.parse_args(argv)
    if job:
        from fastdecode.launch.ranks import set_groups, set_s_ranks
        set_s_ranks(getattr(args, "tensor_parallel_size", 1))   # which ranks are the S-worker's (role names)
        set_groups(getattr(args, "data_parallel_size", 1))
    if args.command == "generate" and args.dry_run:
        return cmd_dry_run(args) if rank == 0 else EXIT_OK
    if job and supervise.should_supervise():  # under a launcher: a dead rank gets named
        summary = None
        if args.command == "generate":
            from fastdecode.batch.stdio import summary_path
            summary = summary_path(args)
        return supervise.run_supervised(words, summary)
    if rank == 0 and args.command == "profile":
        from fastdecode.batch.interrupt import STOP
        STOP.release()                        # profile saves nothing: a stop signal ends it
    handlers = {"generate": cmd_generate, "profile": cmd_profile, "plan": cmd_plan, "simulate": cmd_simulate,
                "report": cmd_report, "info": cmd_info}
    return handlers[args.command](args)


def take_stop_signals(rank: int) -> None:
    """R-workers outlive SLURM's stop signals (rank 0 finishes the step and shuts them down): they
    ignore them from the start, one arriving while a rank still loads would kill it. Rank 0 records
    them (batch/interrupt.py), so a stop at any moment is a clean stop; its supervisor forwards them."""
    if rank > 0:
        for sig in mpi_env.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    else:
        from fastdecode.batch.interrupt import STOP
        STOP.install()

if __name__ == "__main__":
    sys.exit(main())
