"""`fastdecode simulate`: a job's tokens/s, per-token latency, each side's utilisation and bubbles,
from a profile (measured, or stated hardware as `plan` takes it) and a request trace.

    fastdecode simulate --profile profile.json --trace requests.jsonl --rworkers 2 -o sim.json --plot sim.png
    fastdecode simulate --model llama-2-7b --gpu-profile a10 --cpu-bw 150 --rworkers 4 \\
        --requests 2000 --prompt-len lognormal:512:0.5 --output-len uniform:64:512 --max-batch 512
    fastdecode simulate --model llama-3-8b --gpu-profile h100 --rworkers 0 --requests 500   # GPU-only

The S-worker's own KV tier is the profile's (a stated GPU's by default; plan's --device-kv flags).
"""
from __future__ import annotations

import argparse
import json
import sys

from fastdecode.engine_options import kv_dtype_or_model
from fastdecode.sizing.hardware_options import add_hardware_options
from fastdecode.sizing.plan import PlanError, build_profile, check_hardware


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def add_parser(subparsers) -> argparse.ArgumentParser:
    from fastdecode.engine_options import positive_float, positive_int
    p = subparsers.add_parser("simulate", help="simulate a job: tokens/s, latency, utilisation from a profile",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_hardware_options(p)
    p.add_argument("--kv-dtype", type=kv_dtype_or_model, metavar="{auto,fp32,bf16,fp16,int8}",
                   help="KV-cache dtype, as generate's --kv-dtype (default auto: the profile's, or the model's)")
    wl = p.add_argument_group("requests (a trace file, or distributions)")
    wl.add_argument("--trace", help="JSONL or JSON of requests: prompt_len, output_len, optional max_tokens "
                                    "and arrival_s (docs/simulate.md); replaces the flags below")
    wl.add_argument("--requests", type=positive_int, default=1000, help="requests to draw (default: %(default)s)")
    wl.add_argument("--prompt-len", default="512", help="prompt tokens: N, uniform:LO:HI or lognormal:MEAN:SIGMA "
                                                        "(default: %(default)s)")
    wl.add_argument("--output-len", default="256", help="tokens each request generates, as --prompt-len "
                                                        "(default: %(default)s)")
    wl.add_argument("--max-tokens", type=positive_int, default=None,
                    help="every request's max_tokens, the bound admission sees; longer outputs are cut to it "
                         "(default: each request's own output length: no early stop)")
    wl.add_argument("--arrival-rate", type=positive_float, default=None,
                    help="Poisson arrivals, requests/s (default: all queued at the start, a batch job)")
    wl.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths and arrivals (default 0)")
    job = p.add_argument_group("the job (generate's flags of the same names)")
    job.add_argument("--rworkers", type=_nonneg_int, default=None,
                     help="R-workers; 0 with the S-worker's own tier: a GPU-only engine (default: as many as the "
                          "profile measured)")
    job.add_argument("--pipeline-depth", type=positive_int, default=2, help="mini-batches in flight (default 2)")
    job.add_argument("--max-batch", type=positive_int, default=None,
                     help="most sequences decoding at once (default 256 for a CPU S-worker, 4096 otherwise)")
    job.add_argument("--max-prefill-tokens", type=positive_int, default=8192,
                     help="prompt tokens prefilled per step (default: %(default)s)")
    job.add_argument("--schedule", default="fifo", choices=["fifo", "stabilized"], help="admission (default fifo)")
    job.add_argument("--target-batch", type=positive_int, default=None, help="stabilized: B (default --max-batch)")
    job.add_argument("--admit-every", type=positive_int, default=None, help="stabilized: F steps (default S/16)")
    job.add_argument("--max-gen", type=positive_int, default=None,
                     help="stabilized: generation length S (default: estimated from the requests)")
    job.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True,
                     help="start a sequence only while it raises tokens/s (generate's --balance; default on)")
    job.add_argument("--stabilize-lengths", default="learnt", choices=["learnt", "max-tokens"],
                     help="stabilized: project with learnt lengths (default) or max_tokens")
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", help="write the result JSON here (summary, timeline, per-step rows)")
    out.add_argument("--plot", help="write a PNG of the run here (needs matplotlib)")
    out.add_argument("--json", action="store_true", help="print the summary as JSON (default: a few lines)")
    out.add_argument("--no-numba", action="store_true",
                     help="run the event loop as plain Python even where numba is installed (same results)")
    out.add_argument("--span-steps", action="store_true",
                     help="take the steps between two events (a start, an end) in closed form: much faster on "
                          "long generations at small batches; figures within about 1%% of stepping each step")
    return p


def _trace(args):
    from fastdecode.sim.trace import load_trace, synthetic_trace
    if args.trace:
        return load_trace(args.trace)
    return synthetic_trace(args.requests, args.prompt_len, args.output_len, args.max_tokens, args.arrival_rate,
                           args.seed)


def _config(args, prof):
    from fastdecode.sim.core import SimConfig
    rworkers = len(prof.r_workers) if args.rworkers is None else args.rworkers
    if rworkers == 0 and prof.device_tier is None:
        raise PlanError("--rworkers 0 needs the S-worker's own KV tier (the profile has none, or --no-device-kv)")
    max_batch = args.max_batch or (256 if prof.s_worker.device.startswith("cpu") else 4096)
    return SimConfig(rworkers=rworkers, depth=args.pipeline_depth, schedule=args.schedule, max_batch=max_batch,
                     max_prefill_tokens=args.max_prefill_tokens, target_batch=args.target_batch,
                     admit_every=args.admit_every, max_gen=args.max_gen,
                     learn_lengths=args.stabilize_lengths == "learnt", use_numba=not args.no_numba,
                     balance=args.balance, span_steps=args.span_steps)


def simulate_args(args) -> dict:
    """The simulation `args` ask for -> its document (fastdecode/sim/report.py)."""
    from dataclasses import asdict

    from fastdecode.sim.core import simulate
    from fastdecode.sim.costs import costs_of
    from fastdecode.sim.groups import group_trace, job_summary
    from fastdecode.sim.report import document, summary
    check_hardware(args)
    prof = build_profile(args)
    cfg = _config(args, prof)
    trace = _trace(args)
    groups = args.data_parallel_size
    costs = costs_of(prof, cfg.rworkers, cfg.max_batch)
    traces = [group_trace(trace, g, groups) for g in range(groups)] if groups > 1 else [trace]
    if min(len(t) for t in traces) == 0:
        raise PlanError(f"--data-parallel-size {groups} needs at least {groups} requests, one for each group")
    runs = [simulate(costs, t, cfg) for t in traces]
    setting = {k: v for k, v in asdict(cfg).items() if k not in ("use_numba", "max_steps")}
    setting["pipeline_depth"] = setting.pop("depth")
    setting.update(model=prof.model.name, s_worker=prof.s_worker.device, profile_source=prof.source,
                   trace=args.trace, device_tier=asdict(prof.device_tier) if prof.device_tier is not None else None,
                   data_parallel_size=groups)
    doc = document(runs[0], traces[0], setting)          # group 0's steps and timeline
    if groups > 1:
        doc["summary"] = job_summary(doc["summary"], [summary(r, t) for r, t in zip(runs, traces)])
        doc["trace"] = trace.describe()
    return doc


def _print(doc: dict) -> None:
    s = doc["summary"]
    u = s["utilisation"]
    print(f"simulated {s['requests_finished']}/{s['requests']} requests, {s['output_tokens']} output tokens in "
          f"{s['wall_s']:.2f} s: {s['output_tokens_per_s']:.1f} tokens/s")
    if "data_parallel_groups" in s:
        rates = ", ".join(f"{g['output_tokens_per_s']:.1f}" for g in s["data_parallel_groups"])
        print(f"{len(s['data_parallel_groups'])} data-parallel groups: {rates} tokens/s each; the last ended "
              f"{s['group_end_spread_s']:.2f} s after the first (the details below are group 0's)")
    if s["token_latency_p50_s"] is not None:
        print(f"per-token latency p50 {s['token_latency_p50_s'] * 1e3:.2f} ms, p99 {s['token_latency_p99_s'] * 1e3:.2f} ms")
    print(f"utilisation: S-worker {u['s_worker']:.0%}"
          + (f" (its KV tier's attention {u['device_tier']:.0%}, holding {s['tier_kv_share']:.0%} of the KV)"
             if s["tier_kv_share"] else "")
          + ", R-workers " + (", ".join(f"{x:.0%}" for x in u["r_workers"]) or "none")
          + f", link out {u['link_out']:.0%} back {u['link_back']:.0%}")
    if s["decode_s"]:
        print(f"decode bubbles: S idle {s['s_bubble_fraction']:.0%}, R idle {s['r_bubble_fraction']:.0%} "
              f"of decode time; bound: {s['bound']}; {s['running_mean']:.1f} sequences running on average")


def run(args) -> int:
    from fastdecode.sim.trace import TraceError
    try:
        doc = simulate_args(args)
    except (PlanError, TraceError, ValueError) as e:
        print(f"fastdecode simulate: error: {e}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        from fastdecode.sim.plot import write_png
        try:
            write_png(doc, args.plot)
        except ImportError:
            print("fastdecode simulate: --plot needs matplotlib (pip install 'fastdecode[plot]')", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(doc["summary"], indent=1))
    else:
        _print(doc)
    return 0
