"""`fastdecode profile`'s command line: its options (the engine's machine options and the grids;
none of generate's admission options), the full or --quick settings, and rank 0's run, which
says how long it will take before it starts."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

FULL_HELP = {"batches": "1..512 on CPU, 1..16384 on CUDA", "prompt_lens": "16,128,256,512,768,1024,1536,2048",
             "repeats": "3", "r_seqs": "64", "r_bytes": "3x the largest CPU cache, >= 256M, so it streams from memory",
             "link_sizes": "64,1K,16K,256K,1M,4M,16M,64M"}
QUICK_HELP = {"batches": "1,16,64 on CPU, 1,256,4096 on CUDA", "prompt_lens": "16,128", "repeats": "1",
              "r_seqs": "8", "r_bytes": "the largest CPU cache, >= 64M", "link_sizes": "64,16K,1M,16M"}


def _default(name: str) -> str:
    return f"(default {FULL_HELP[name]}; --quick: {QUICK_HELP[name]})"


def add_parser(sub, add_engine_options) -> argparse.ArgumentParser:
    from fastdecode.engine_options import bytes_arg, positive_int

    def int_list(text: str) -> list[int]:
        return [positive_int(x) for x in text.split(",")]

    def size_list(text: str) -> list[int]:
        sizes = sorted(bytes_arg(x) for x in text.split(","))
        if len(sizes) < 2 or sizes[0] < 1:
            raise argparse.ArgumentTypeError(f"need two or more sizes of at least 1 byte, got {text!r}")
        return sizes

    pr = sub.add_parser("profile", help="measure T_S(B), R-worker attention cost and the S<->R link",
                        description="Measure what `fastdecode plan` needs. Under mpirun every R-worker is measured. "
                                    "Says how long it will take before it starts.")
    pr.add_argument("-o", "--output", default="profile.json", help="profile JSON to write (default profile.json)")
    pr.add_argument("--quick", action="store_true",
                    help="a small grid, one repetition, shorter timings and (unless --max-prefill-tokens is "
                         "given) a prefill chunk of 512 tokens on CPU, 4096 on CUDA: rougher, in about a minute "
                         "on a small model; options given explicitly still apply")
    add_engine_options(pr)
    pr.add_argument("--batches", type=int_list, default=None,
                    help=f"comma-separated batch grid for T_S(B) {_default('batches')}")
    pr.add_argument("--r-seqs", type=positive_int, default=None,
                    help=f"sequences per R-worker timing call {_default('r_seqs')}")
    pr.add_argument("--r-bytes", type=bytes_arg, default=None,
                    help=f"KV bytes of the long R-worker timing {_default('r_bytes')}")
    pr.add_argument("--repeats", type=positive_int, default=None,
                    help=f"timed repetitions, the median kept {_default('repeats')}")
    pr.add_argument("--prompt-lens", type=int_list, default=None,
                    help=f"comma-separated prompt lengths for the prefill cost {_default('prompt_lens')}")
    pr.add_argument("--link-sizes", type=size_list, default=None,
                    help="comma-separated one-way message sizes for the S<->R link, bytes or with K/M/G; "
                         "the bandwidth is fitted over those of 256K and more, so give two such "
                         f"{_default('link_sizes')}")
    return pr


def settings_of(args, cuda: bool):
    """The full profile's settings or --quick's, with every option given explicitly on top."""
    from fastdecode.sizing.profile import ProfileSettings, quick_settings
    st = quick_settings(cuda) if args.quick else ProfileSettings()
    for name in ("batches", "prompt_lens", "repeats", "r_seqs", "r_bytes", "link_sizes"):
        if getattr(args, name) is not None:
            setattr(st, name, getattr(args, name))
    return st


def run_s_worker(args, comm) -> int:
    """Rank 0 of `fastdecode profile`: build the engine, say how long it will take, measure, write."""
    from fastdecode.engine_options import engine_args
    from fastdecode.engine.args import resolve_device
    from fastdecode.tp.engines import s_worker_engine
    from fastdecode.sizing.estimate import estimate, estimate_line
    from fastdecode.sizing.profile import QUICK_PREFILL_TOKENS, run_profile

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    device = resolve_device(args.device)
    if args.quick and args.max_prefill_tokens is None:
        args.max_prefill_tokens = QUICK_PREFILL_TOKENS["cuda" if device.type == "cuda" else "cpu"]
    engine = s_worker_engine(engine_args(args), comm)
    try:
        settings = settings_of(args, engine.device.type == "cuda")
        parts, costs = estimate(engine, settings)
        log(estimate_line(parts, costs, args.quick))
        start = time.perf_counter()
        prof = run_profile(engine, settings, log=log)
        log(f"profile: took {time.perf_counter() - start:.0f} s (estimated {sum(parts.values()):.0f} s)")
    finally:
        engine.close()
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(prof.to_dict(), indent=1))
    os.replace(tmp, args.output)
    print(f"profile written to {args.output}; next: fastdecode plan --profile {args.output} --context S --batch B")
    return 0
