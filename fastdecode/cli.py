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

from fastdecode.launch import mpi_env

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _pipeline_depth(text: str) -> int:
    from rworker.protocol.control import MAX_MINIBATCHES
    v = positive_int(text)
    if v > MAX_MINIBATCHES:
        raise argparse.ArgumentTypeError(f"at most {MAX_MINIBATCHES} mini-batches in flight, got {v}")
    return v


def bytes_arg(text: str) -> int:
    from rworker.host.capacity import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_or_auto(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else bytes_arg(text)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return v


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine options every command that builds an engine uses (generate, profile)."""
    p.add_argument("-m", "--model", default="smollm2-135m",
                   help="HF model directory, .gguf file, or embedded name (default: smollm2-135m)")
    p.add_argument("--device", default="auto", help="S-worker device: auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="S-part weights/activations (auto: float32 on CPU, bfloat16 on CUDA; bfloat16 on a CPU "
                        "with AVX512-BF16 prefills ~3x as fast: docs/tuning.md)")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: the projections' weights in float8_e4m3fn with per-channel scales, half of bf16's "
                        "bytes (vLLM's flag); GEMMs in fp8 on GPUs with fp8 (sm89+), elsewhere the weights "
                        "dequantize at each use. An fp8 checkpoint (compressed-tensors, fbgemm_fp8) is served "
                        "fp8 without it. Embeddings, norms and the LM head stay in --dtype")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "int8"],
                   help="KV-cache element type on the R-workers (auto: fp32 for float32 models, else bf16; int8: "
                        "per-token scales, about half of bf16's bytes read per token: docs/tuning.md)")
    p.add_argument("--attn-probs", default="fp32", choices=["fp32", "bf16"],
                   help="precision of the attention probabilities in the R-workers' PV product: bf16 (with bf16 KV) "
                        "lets an R-worker with AVX512-BF16 store V in token pairs and use bf16 dot products where its "
                        "start-up tune finds that faster (as FlashAttention rounds P; outputs within a bf16 bound, "
                        "not bit-equal; default fp32)")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=None,
                   help="prompt tokens prefilled per step (default 8192; on CUDA up to 32768 as memory allows)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="chunked prefill (vLLM's name): tokens per step, a decode row counting one; the running "
                        "sequences' decode rows come first, prompts are prefilled in chunks of what is left, so "
                        "a long prompt never stalls decoding (at least --max-batch; default: off, whole prompts "
                        "up to --max-prefill-tokens per step)")
    p.add_argument("--s-threads", type=positive_int, default=None, help="torch threads on a CPU S-worker")
    p.add_argument("--r-threads", type=positive_int, default=None,
                   help="kernel threads per R-worker (default: the physical cores it may use)")
    p.add_argument("--rworker-mem", type=bytes_arg, default=None,
                   help="KV-cache bytes per R-worker, e.g. 64G (default: available memory less a reserve)")
    p.add_argument("--device-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="the S-worker keeps some sequences' KV in its own memory and attends to them itself "
                        "(its GPU's, or on a CPU S-worker beside R-workers its in-process store), the R-workers "
                        "the rest; each sequence goes where its step ends earliest, from the tiers' measured "
                        "speeds (default); --no-device-kv puts all KV on the R-workers")
    p.add_argument("--device-kv-memory", type=_size_or_auto, default=None,
                   help="bytes of the S-worker's own KV tier, e.g. 40G (default auto: on a GPU what is free "
                        "after the weights and the activations' reserve, under --gpu-memory-utilization; on a "
                        "CPU S-worker an equal share of its node's memory with the R-workers there)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="GPU S-worker: the fraction of the card's memory the job may fill, weights, "
                        "activations and its KV tier together (vLLM's; default 0.9)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a rank may stay silent before the job aborts naming it (default: 900 until "
                        "a step was timed, then 50x the slowest step, at least 300)")
    p.add_argument("--pipeline-depth", type=_pipeline_depth, default=2,
                   help="mini-batches in flight: the S-part of one runs while the R-workers attend the "
                        "others (1 = S and R take turns)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA S-worker: replay each layer's dense work of a mini-batch from a CUDA graph "
                        "(fewer launches at small batches; captured on first use per row bucket)")
    p.add_argument("--cuda-graph-max-rows", type=positive_int, default=2048,
                   help="largest mini-batch run from CUDA graphs; larger ones run eagerly (default 2048)")


def add_generate_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine options only a serving run uses (batching, memory per sequence, admission, seeds)."""
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="most sequences decoding at once (default 256 on a CPU S-worker, 4096 on CUDA)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + generation served (default: the model's context). Each sequence "
                        "reserves R-worker memory for prompt + max_tokens, and a request without max_tokens "
                        "for the whole context: a shorter limit lets more sequences run at once")
    p.add_argument("--kv-reserve", default="full", choices=["full", "grow"],
                   help="R-worker memory per sequence: full (its worst case, prompt + max_tokens, at admission: "
                        "never preempted; default) or grow (page by page as it grows; when a worker is full the "
                        "youngest sequences there are preempted and later recomputed, as vLLM does)")
    p.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=True,
                   help="prompts that start with the same whole KV pages as a running one (a shared system "
                        "prompt, n samples) prefill only the rest and read those pages on its R-worker, stored "
                        "once (default); --no-prefix-sharing prefills and stores every prompt in full")
    p.add_argument("--prefix-kept-tokens", type=positive_int, default=8192,
                   help="most shared-prefix tokens whose K/V rank 0 keeps for the prompts that start from them "
                        "(default 8192; past it a prompt prefills in full)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that carry no seed (default 0)")
    p.add_argument("--schedule", default="fifo", choices=["fifo", "stabilized"],
                   help="admission: fifo (fill up to --max-batch) or stabilized (micro-batches that keep "
                        "the R-workers' KV load steady; FastDecode's load-stabilizing schedule)")
    p.add_argument("--target-batch", type=positive_int, default=None,
                   help="stabilized: target number of running sequences B (default --max-batch)")
    p.add_argument("--admit-every", type=positive_int, default=None,
                   help="stabilized: steps F between micro-batches of B*F/S sequences (default S/16)")
    p.add_argument("--max-gen", type=positive_int, default=None,
                   help="stabilized: generation length S (default: estimated from the requests' max_tokens)")
    p.add_argument("--stabilize-lengths", default="learnt", choices=["learnt", "max-tokens"],
                   help="stabilized: project running sequences with lengths learnt from finished ones "
                        "(EOS; default), or as if each runs to its max_tokens")


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
    g.add_argument("--sort-output", dest="sort_output", action=argparse.BooleanOptionalAction, default=True,
                   help="when the input is done, rewrite the output in input order, lines of earlier runs "
                        "included (default); --no-sort-output keeps completion order")
    g.add_argument("--overwrite", action="store_true",
                   help="start over: empty an existing output file (default: resume, skipping the lines it "
                        "already answers)")
    g.add_argument("--summary-json", default=None,
                   help="run report: throughput, token latency, R-worker load, errors by code, runs "
                        "(default: OUTPUT.summary.json)")
    g.add_argument("--index-dir", default=None,
                   help="directory for the scratch index of custom_ids while resuming/deduplicating "
                        "(default: $TMPDIR or /tmp; node-local disk is best)")
    g.add_argument("--stats-json", default=None, help="write per-step statistics and a summary here")
    g.add_argument("--quiet", action="store_true",
                   help="no progress lines and no R-worker roster at start-up (results, warnings and errors "
                        "still print)")
    g.add_argument("--progress-interval", type=positive_float, default=None, metavar="SECONDS",
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
                      help="also name this model's architecture, shape and attention variants (its config only: "
                           "no weights are read); an unsupported model exits 2 with the reason")
    return parser


# ---------------------------------------------------------------------------- validation (no MPI, no torch)

def validate_generate(args) -> None:
    from fastdecode.batch.paths import check_paths
    from fastdecode.batch.progress import interval_from
    try:
        check_paths(args)
        if not args.quiet:
            interval_from(args.progress_interval)
    except ValueError as e:
        raise UsageError(str(e)) from None
    bad = [n for n in args.served_model_name or () if not n.strip()]
    if bad:
        raise UsageError(f"--served-model-name: a name must be non-empty, got {bad[0]!r}")
    check_model(args)


def check_model(args) -> None:
    """The model's config is readable and servable, --max-model-len fits it, and a chunked-prefill
    budget holds --max-batch decode rows."""
    from fastdecode.engine.args import check_batch_budget, default_max_batch, resolve_device
    from fastdecode.model.config import ConfigError
    from fastdecode.model.quantization import weight_format
    from fastdecode.model.source import read_config, resolve_model
    try:
        source = resolve_model(args.model)
        read_config(source).resolve_max_model_len(getattr(args, "max_model_len", None))
        weight_format(getattr(args, "quantization", None), source)     # an fp8 checkpoint's scales, too
    except ConfigError as e:
        raise UsageError(str(e)) from None
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
    command line on rank 0, agree, split roles."""
    from fastdecode.launch.env_vars import environment_error
    rank, size = mpi_env.launched_rank(), mpi_env.launched_size()
    error = environment_error(runs_kernels=rank > 0 or size <= 1)
    if rank == 0 and error is None:
        try:
            validate(args)
        except UsageError as e:
            error = str(e)
    if size <= 1 and error:                              # a singleton: stop before MPI starts
        print(f"fastdecode: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    comm = mpi_env.world(args.timeout)
    if comm is not None:
        if agree_on_usage(comm, error):
            return EXIT_USAGE
        rank0_address = mpi_env.share_end_notices(comm)      # a rank that fails or dies is reported
        if comm.Get_rank() != 0:
            from rworker.worker import run
            return run(comm, args.r_threads, args.rworker_mem, args.timeout, end_notice_to=rank0_address)
    elif error:
        print(f"fastdecode: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return s_worker_main(args, comm)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - must end the MPI job, not hang it
        mpi_env.fail(comm, e)
        return EXIT_FAILURE


def cmd_generate(args) -> int:
    return run_job(args, validate_generate, run_s_worker)


def engine_args(args):
    """EngineArgs from a command's options; what a command does not offer keeps EngineArgs' default
    (profile has no admission or seed options)."""
    import dataclasses

    from fastdecode.engine.args import EngineArgs
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    if hasattr(args, "stabilize_lengths"):
        given["learn_lengths"] = args.stabilize_lengths == "learnt"
    return EngineArgs(**given)


def run_s_worker(args, comm) -> int:
    """Rank 0: resume from the output, serve, and on SIGUSR1/SIGTERM/SIGINT stop after the step in
    flight, save, shut the R-workers down and exit 75 (the SLURM scripts requeue on it)."""
    from fastdecode.batch.generate import print_report, run_generate
    from fastdecode.batch.interrupt import STOP

    # installed as the process started and kept to the exit: a signal at any point is a clean
    # stop, never the default action (which would end rank 0 without a report)
    stop = STOP.install()
    engines = []

    def make_engine():
        from fastdecode.engine.llm_engine import LLMEngine
        engines.append(LLMEngine(engine_args(args), comm))
        return engines[0]

    # the output is read before the model loads: a rerun that finds every line answered makes no
    # engine, and the R-workers end before their start-up (and kernel tune)
    summary, rep, interrupted = run_generate(make_engine, args, stop, skip_engine=lambda: mpi_env.stop_rworkers(comm))
    if summary is not None:
        if args.stats_json:
            engines[0].recorder.write(args.stats_json, summary)
        print_report(summary, rep)
    return mpi_env.EXIT_TEMPFAIL if interrupted else EXIT_OK


def validate_model(args) -> None:
    check_model(args)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise UsageError(f"output {args.output}: directory {out_dir} does not exist or is not writable")


def cmd_profile(args) -> int:
    from fastdecode.sizing.profile_cli import run_s_worker
    return run_job(args, validate_model, run_s_worker)


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
            info.update(model_info(args.model))
        except ConfigError as e:                  # as generate's check of the model: a usage error
            print(render(info))
            print(f"fastdecode info: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    print(render(info))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
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
    if job and supervise.should_supervise():  # under a launcher: a dead rank gets named
        summary = None
        if args.command == "generate":
            from fastdecode.batch.report import default_path
            summary = args.summary_json or default_path(args.output)
        return supervise.run_supervised(words, summary)
    if rank == 0 and args.command == "profile":
        from fastdecode.batch.interrupt import STOP
        STOP.release()                        # profile saves nothing: a stop signal ends it
    handlers = {"generate": cmd_generate, "profile": cmd_profile, "plan": cmd_plan, "simulate": cmd_simulate, "report": cmd_report,
                "info": cmd_info}
    return handlers[args.command](args)


def take_stop_signals(rank: int) -> None:
    """R-workers outlive SLURM's stop signals (rank 0 finishes the step and shuts them down): they
    ignore them from the start, one arriving while a rank still loads would kill it. Rank 0 records
    them (batch/interrupt.py), so a stop at any moment is a clean stop; its supervisor forwards them."""
    if rank > 0:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    else:
        from fastdecode.batch.interrupt import STOP
        STOP.install()

if __name__ == "__main__":
    sys.exit(main())
