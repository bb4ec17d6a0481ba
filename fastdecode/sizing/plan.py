"""`fastdecode plan`: R-workers needed, step latency, tokens/s and the bounding side, before a job.

From a measured profile (`--profile profile.json`) or stated hardware (`--gpu-profile`,
`--cpu-bw`, `--rworker-mem`, `--link-bw`, `--model`, `--device-kv-memory`, `--device-kv-gbps`); stated
flags given with a profile replace those parts of it (what-if). With the S-worker's own KV tier
(the profile's, a stated GPU's by default, or stated) it says how the batch splits between the tier
and the R-workers; `--rworkers 0` plans a GPU-only engine. What runs of a batch follows the
engine's balance rule (sizing/balance.py): the tier first where it is the faster place, the
R-workers only while one more sequence raises tokens/s. Without --batch it sweeps B from 1 to what
memory holds, marks the knee of E(B) and says the best. Given several counts (`--rworkers 0 1 2
4`), it gives each count's best tokens/s, the card alone first, and what each socket adds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from fastdecode.engine_options import kv_dtype_or_model
from fastdecode.model.hf_cache import looks_like_repo_id
from fastdecode.sched.placement import RESERVE_POLICIES as KV_RESERVE
from fastdecode.sizing import plan_text as text
from fastdecode.sizing.balance import Workload, best_depth, best_per_sockets, sweep_batches
from fastdecode.sizing.fidelity import fidelity, fidelity_line
from fastdecode.sizing.hardware_options import (
    STATED_LINK_BW_GBPS,
    STATED_LINK_LATENCY_US,
    STATED_OVERHEAD_US,
    add_hardware_options,
    stated_memory,
)
from fastdecode.sizing.hardware import (
    GPU_PRESETS,
    GpuSpec,
    s_worker_from_spec,
    stated_profile,
    stated_tier,
)
from fastdecode.sizing.link_report import link_report
from fastdecode.sizing.model import Prediction, predict_run
from fastdecode.sizing.plan_sockets import report_sockets
from fastdecode.sizing.schema import MODEL_PRESETS, ModelDims, Profile, from_known_keys
from fastdecode.sizing.split import Split
from fastdecode.sizing.tensor_parallel import (
    sizing_from_args,
    stated_tier_over,
    with_tensor_parallel,
)
from rworker.protocol.kvformat import kv_elem_bytes

AUTO_DEPTH = "auto"         # --pipeline-depth: the better of 1 and 2 at each batch
ENGINE_DEPTH = 2            # generate's default --pipeline-depth: where the knee is counted under auto




def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="predict R-workers needed, latency and throughput", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_hardware_options(p)
    tgt = p.add_argument_group("target")
    tgt.add_argument("--output-len", "--context", dest="context", type=int, default=1024,
                     help="tokens each sequence generates, S, after its prompt, as vLLM's benchmarks' "
                          "--output-len; prompt + S is what vLLM's --max-model-len bounds (default: %(default)s)")
    tgt.add_argument("--prompt-len", type=int, default=0, help="prompt length, tokens, as vLLM's --input-len "
                                                                "(default: %(default)s)")
    tgt.add_argument("--requests", type=int, default=None,
                     help="with several --rworkers: the job's request count; each row adds the job's tokens/s, "
                          "its ramp and drain included (fastdecode/sizing/job.py)")
    tgt.add_argument("--batch", type=int, help="batch B offered (default: a sweep over B from 1 to what memory "
                                                "holds)")
    tgt.add_argument("--rworkers", type=int, nargs="+", metavar="P",
                     help="R-workers (CPU sockets) P; 0 with the S-worker's own tier: a GPU-only engine; several "
                          "counts: each one's best tokens/s and what it adds, the card alone (0) first "
                          "(default: the number needed)")
    tgt.add_argument("--pipeline-depth", type=_depth, default=AUTO_DEPTH,
                     help=f"mini-batches in flight, 1 = no pipeline; {AUTO_DEPTH}: the better of 1 and 2 at each "
                          f"batch, named where it is not generate's default ({ENGINE_DEPTH}) (default: %(default)s)")
    tgt.add_argument("--prefill-chunk", type=int, default=None,
                     help="prompt tokens per prefill chunk (default: one admitted micro-batch, B/16 prompts, "
                          "up to the profile's largest chunk)")
    tgt.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                     help="tokens at the start of every prompt shared by a group of sequences (a system "
                          "prompt, n > 1 samples), held once per group on the R-workers and prefilled "
                          "once; whole pages of 32 (default: %(default)s)")
    tgt.add_argument("--prefix-group", type=int, default=None, metavar="N",
                     help="sequences sharing one copy of the prefix, 1 = no sharing (default: the whole batch)")
    tgt.add_argument("--kv-dtype", type=kv_dtype_or_model, metavar="{auto,fp32,bf16,fp16,int8}",
                     help="KV-cache dtype, as generate's --kv-dtype (default auto: the model's dtype)")
    tgt.add_argument("--kv-reserve", choices=KV_RESERVE, default="full",
                     help="how the run reserves KV (generate's --kv-reserve): full holds each sequence's "
                          "prompt + S from admission on, grow only what it has filled, about half "
                          "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    return p


def _depth(text: str) -> int | str:
    """--pipeline-depth: a count, or AUTO_DEPTH."""
    if text == AUTO_DEPTH:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or {AUTO_DEPTH!r}, got {text!r}") from None


class PlanError(ValueError):
    pass


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {path}: {e}") from None


def _model(name: str) -> ModelDims:
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    label = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if not os.path.isfile(path) and looks_like_repo_id(name):         # org/name: its config in the local HF cache
        from fastdecode.model.source import resolve_model
        path, label = os.path.join(resolve_model(name).path, "config.json"), name
    if not os.path.isfile(path):
        raise PlanError(f"unknown model {name!r}: not a preset ({', '.join(MODEL_PRESETS)}) nor a config.json")
    try:
        return ModelDims.from_hf_config(_load_json(path), name=label)
    except KeyError as e:
        raise PlanError(f"{path}: missing {e}") from None


def _gpu(name: str) -> GpuSpec:
    if name in GPU_PRESETS:
        return GPU_PRESETS[name]
    if not os.path.isfile(name):
        raise PlanError(f"unknown GPU {name!r}: not a preset ({', '.join(GPU_PRESETS)}) nor a JSON file")
    try:
        return from_known_keys(GpuSpec, _load_json(name))
    except TypeError as e:
        raise PlanError(f"{name}: {e}") from None


def build_profile(args) -> Profile:
    """The profile to plan with: measured, stated, or measured with stated parts replaced."""
    stated_link = dict(link_bw_GBps=args.link_bw or STATED_LINK_BW_GBPS, link_latency_us=(
        STATED_LINK_LATENCY_US if args.link_latency is None else args.link_latency))
    overhead = STATED_OVERHEAD_US if args.rworker_overhead_us is None else args.rworker_overhead_us
    if not args.profile:
        counts = socket_counts(getattr(args, "rworkers", None))
        gpu_only = bool(counts) and not any(counts) and args.device_kv
        missing = [f for f, v in (("--gpu-profile", args.gpu_profile), ("--model", args.model),
                                  ("--cpu-bw", args.cpu_bw or gpu_only or None)) if v is None]
        if missing:
            raise PlanError(f"give --profile, or stated hardware (missing {' '.join(missing)})")
        model, gpu, tp = _model(args.model), _gpu(args.gpu_profile), sizing_from_args(args)
        tier = _stated_tier(gpu, model, tp, args) if args.device_kv else None
        mem_gb, reserve = stated_memory(args)
        if args.cpu_bw is None and tier is None:
            raise PlanError(f"{model.name}'s weights leave no room for a KV tier on {gpu.name}: give --cpu-bw "
                            f"(R-workers) or --device-kv-memory")
        return with_tensor_parallel(
            stated_profile(gpu, model, args.cpu_bw, mem_gb, mem_reserve=reserve, cpu_attn_eff=args.cpu_eff,
                           call_overhead_us=overhead,
                           kv_dtype_bytes=kv_elem_bytes(args.kv_dtype, model.head_dim) if args.kv_dtype else None,
                           shared_cost_ratio=args.shared_cost_ratio or 1.0, device_tier=tier, **stated_link),
            tp, gpu)
    try:
        prof = Profile.from_dict(_load_json(args.profile))
    except (TypeError, KeyError, ValueError) as e:
        raise PlanError(f"{args.profile}: not a fastdecode profile ({e})") from None
    if args.model:
        model = _model(args.model)
        if not args.gpu_profile and dataclasses.replace(model, name="") != dataclasses.replace(prof.model, name=""):
            raise PlanError(f"the profile's S-part was measured for {prof.model.name}; "
                            f"give --gpu-profile to plan {model.name}")
        prof.model = model
    if args.gpu_profile:
        prof.s_worker = s_worker_from_spec(_gpu(args.gpu_profile), prof.model)
    for w in prof.r_workers:
        if args.cpu_bw is not None:
            w.seconds_per_kv_byte = 1.0 / (args.cpu_bw * 1e9 * args.cpu_eff)
            w.kernel_seconds_per_kv_byte = 0.0      # the stated rate replaces the measured kernel's too
        if args.rworker_mem is not None:
            w.capacity_bytes = args.rworker_mem
        if args.rworker_overhead_us is not None:
            w.call_overhead_s = overhead * 1e-6
        if args.shared_cost_ratio is not None:
            w.shared_cost_ratio = args.shared_cost_ratio
            w.shared_seconds_per_kv_byte = 0.0     # the stated ratio replaces the measured cost
    if args.link_bw is not None or args.link_latency is not None:    # the measured tables no longer hold:
        prof.link = dataclasses.replace(                                # one stated path for every worker
            prof.link, message_bytes=[], message_time_s=[], worker_names=[], worker_message_time_s=[],
            worker_latency_s=[], worker_bandwidth_Bps=[], concurrent_Bps=0.0,
            bandwidth_Bps=prof.link.bandwidth_Bps if args.link_bw is None else args.link_bw * 1e9,
            latency_s=prof.link.latency_s if args.link_latency is None else args.link_latency * 1e-6)
    if args.kv_dtype:
        prof.kv_dtype_bytes = kv_elem_bytes(args.kv_dtype, prof.model.head_dim)
    prof.device_tier = _profile_tier(prof, args)
    if not prof.r_workers and prof.device_tier is None:
        raise PlanError(f"{args.profile} has no R-worker, and --no-device-kv leaves no KV anywhere")
    return with_tensor_parallel(prof, sizing_from_args(args), _gpu(args.gpu_profile) if args.gpu_profile else None)


def _stated_tier(gpu, model, tp, args):
    """The device tier of a stated GPU S-worker (over T GPUs: tensor_parallel.stated_tier_over)."""
    return stated_tier_over(gpu, model, tp, _tier_gb(args), args.device_kv_gbps)


def _tier_gb(args) -> float | None:
    """--device-kv-memory in the sizing model's GB (1e9 bytes)."""
    return None if args.device_kv_memory is None else args.device_kv_memory / 1e9


def _profile_tier(prof: Profile, args):
    """The S-worker's tier to plan a measured profile with: none under --no-device-kv; the profile's
    with any stated part replacing the measured one; stated afresh where the profile has none
    (both figures, or a --gpu-profile to take the missing one from)."""
    gb, gbps = _tier_gb(args), args.device_kv_gbps
    if not args.device_kv:
        return None
    tier = prof.device_tier
    if tier is None:
        if gb is None and gbps is None:
            return None                  # as measured (an older profile, or a job run with --no-device-kv)
        try:
            return stated_tier(_gpu(args.gpu_profile) if args.gpu_profile else None, prof.model, gb, gbps)
        except ValueError:
            raise PlanError(f"{args.profile} has no S-worker tier: state one with both --device-kv-memory and "
                            f"--device-kv-gbps (or --gpu-profile to take the missing one from)") from None
    if gb is not None:
        tier.capacity_bytes = gb * 1e9
    if gbps is not None:
        tier.seconds_per_kv_byte = 1.0 / (gbps * 1e9)
        tier.kernel_seconds_per_kv_byte = 0.0
    return tier


def socket_counts(rworkers) -> list[int]:
    """--rworkers as a list: plan's counts (a list, or None: the number needed), or simulate's one."""
    if rworkers is None:
        return []
    return list(rworkers) if isinstance(rworkers, (list, tuple)) else [rworkers]


def stated_depth(args) -> int | None:
    """--pipeline-depth as stated; None: auto."""
    return None if args.pipeline_depth == AUTO_DEPTH else args.pipeline_depth


# the depth to plan at: as stated; under auto the better of 1 and 2 at each batch, one --batch's too
# (the plan recommends the best depth, and depth_advice names it where it is not generate's default)
plan_depth = stated_depth


def depth_advice(row: dict, args) -> str | None:
    """The flag to give generate where the depth plan chose is not its default."""
    if stated_depth(args) is not None or "tokens_per_s_depth2" not in row:
        return None
    return (f"run generate with --pipeline-depth {row['pipeline_depth']}: its default, {ENGINE_DEPTH}, gives "
            f"{row['tokens_per_s_depth2']:,.0f} tokens/s here")


def _check(args) -> None:
    counts = [("--rworkers", p, 0) for p in socket_counts(args.rworkers)]
    for flag, v, lo in (("--context", args.context, 1), ("--prompt-len", args.prompt_len, 0),
                        ("--batch", args.batch, 1), *counts, ("--pipeline-depth", stated_depth(args), 1),
                        ("--prefill-chunk", args.prefill_chunk, 1), ("--requests", args.requests, 1)):
        if v is not None and v < lo:
            raise PlanError(f"{flag} must be >= {lo} (got {v})")
    if args.requests is not None and len(counts) < 2:
        raise PlanError("--requests prices a job for each of several socket counts: give --rworkers P1 P2 ...")
    check_hardware(args)
    _check_sharing(args)


def check_hardware(args) -> None:
    """The hardware flags' values (add_hardware_options)."""
    if getattr(args, "renamed_flag", None):
        raise PlanError(args.renamed_flag)
    for flag, v in (("--cpu-bw", args.cpu_bw), ("--rworker-mem", args.rworker_mem), ("--link-bw", args.link_bw),
                    ("--cpu-eff", args.cpu_eff), ("--device-kv-gbps", args.device_kv_gbps)):
        if v is not None and not 0 < v < float("inf"):
            raise PlanError(f"{flag} must be a finite number > 0 (got {v})")
    if not args.device_kv and (args.device_kv_memory is not None or args.device_kv_gbps is not None):
        raise PlanError("--no-device-kv with --device-kv-memory or --device-kv-gbps: plan one or the other")
    for flag, v in (("--link-latency", args.link_latency), ("--rworker-overhead-us", args.rworker_overhead_us)):
        if v is not None and not 0 <= v < float("inf"):
            raise PlanError(f"{flag} must be a finite number >= 0 (got {v})")
    if args.shared_cost_ratio is not None and not 0 < args.shared_cost_ratio <= 1:
        raise PlanError(f"--shared-cost-ratio must be in (0, 1] (got {args.shared_cost_ratio})")


def _check_sharing(args) -> None:
    if args.shared_prefix < 0:
        raise PlanError(f"--shared-prefix must be >= 0 (got {args.shared_prefix})")
    if args.shared_prefix > args.prompt_len:
        raise PlanError(f"--shared-prefix must be <= --prompt-len: the shared prefix is part of the prompt "
                        f"(got {args.shared_prefix} > {args.prompt_len})")
    if args.prefix_group is not None and args.prefix_group < 1:
        raise PlanError(f"--prefix-group must be >= 1 (got {args.prefix_group})")


def workload(args) -> Workload:
    """The target flags as the balance rule's Workload."""
    return Workload(args.context, args.prompt_len, args.prefill_chunk, args.kv_reserve, args.shared_prefix,
                    args.prefix_group)


def _split_of(prof: Profile, pred: Prediction) -> Split | None:
    """The split `pred` runs, to price it at other depths (None without a tier: placement's, all
    on the R-workers)."""
    if prof.device_tier is None:
        return None
    return Split(pred.tier_sequences, pred.rworker_sequences, pred.tier_split, pred.tier_capacity_sequences,
                 pred.rworker_capacity_sequences)


def _row(prof: Profile, batch: int, args) -> dict:
    """One batch: what the balance rule runs of it at its (better) depth, the same sequences at
    depth 1, the link's figures, and what --kv-reserve grow would hold."""
    work, share = workload(args), dict(shared_prefix=args.shared_prefix, prefix_group=args.prefix_group)
    rworkers = socket_counts(args.rworkers)
    pred = best_depth(prof, batch, work, rworkers[0] if rworkers else None, plan_depth(args))
    split = _split_of(prof, pred)
    flat = predict_run(prof, batch, args.context, args.prompt_len, pred.rworkers, 1, pred.rworkers_needed, split,
                       args.prefill_chunk, args.kv_reserve, **share)
    row = {**pred.to_dict(), "step_latency_depth1_s": flat.step_latency_s, "tokens_per_s_depth1": flat.tokens_per_s}
    if pred.pipeline_depth != ENGINE_DEPTH:      # what generate's default depth would give: the advice's figure
        row["tokens_per_s_depth2"] = predict_run(prof, batch, args.context, args.prompt_len, pred.rworkers, ENGINE_DEPTH,
                                                 pred.rworkers_needed, split, args.prefill_chunk, args.kv_reserve,
                                                 **share).tokens_per_s
    if pred.rworker_sequences >= 1:          # something crosses the link
        row.update(link_report(prof, pred.batch_run, args.context, args.prompt_len, pred.rworkers,
                               pred.pipeline_depth, kv_reserve=args.kv_reserve, split=split, **share))
    if args.kv_reserve == "full" and pred.bound == "capacity":      # what the other policy would hold
        grow = dataclasses.replace(work, kv_reserve="grow")
        row["batch_run_if_grow"] = best_depth(prof, batch, grow, pred.rworkers, pred.pipeline_depth).batch_run
    return row


def run(args) -> int:
    try:
        _check(args)
        prof = build_profile(args)
        depth = plan_depth(args)
        knee = prof.s_worker.knee() * (depth or ENGINE_DEPTH)     # each mini-batch at the knee
        counts = socket_counts(args.rworkers)
        if len(counts) > 1:
            rows = best_per_sockets(prof, counts, args.context, args.prompt_len, depth,
                                    [args.batch] if args.batch else None, args.prefill_chunk, args.kv_reserve,
                                    args.shared_prefix, args.prefix_group)
            return report_sockets(prof, rows, knee, args, workload(args), depth, _about(prof))
        batches = [args.batch] if args.batch else sweep_batches(prof, workload(args), counts[0] if counts else None,
                                                                 depth, also=(knee,))
        rows = [_row(prof, b, args) for b in batches]
    except (PlanError, ValueError) as e:
        print(f"fastdecode plan: error: {e}", file=sys.stderr)
        return 2
    pick = rows[0] if args.batch else next(r for r in rows if r["batch"] == knee)
    best = text.best_of_rows(rows)
    fid = fidelity(prof.s_worker.device, pick["bound"], prof.source == "measured")
    if args.json:
        out = {**pick, "knee_batch": knee, **_about(prof), "fidelity": fid,
               **text.groups_fields(pick if args.batch else best, args.data_parallel_size)}
        if not args.batch:
            out["sweep"], out["best"] = rows, best
        print(json.dumps(out, indent=1))
        return 0
    print("\n".join(text.header(prof, knee, depth or ENGINE_DEPTH, args)))
    print(text.target_line(args, depth))
    if args.batch:
        text.print_batch(prof, pick, fid, args, depth_advice(pick, args))
        return 0
    text.print_sweep(prof, rows, knee)
    if socket_counts(args.rworkers):                # the best of one machine (the count needed varies by row)
        print(text.best_line(best))
        if best["rworkers"] and prof.device_tier is not None and not best["rworker_sequences"]:
            print(text.card_alone_words(best, best["tokens_per_s"]))
    print(f"at the knee (batch {knee}): " + fidelity_line(fid, pick["bound"]))
    if args.data_parallel_size > 1:
        print(text.groups_line(best, args.data_parallel_size))
    return 0


def _about(prof: Profile) -> dict:
    """--json's keys on the machine planned."""
    return {"model": prof.model.name, "s_worker": prof.s_worker.device, "profile_source": prof.source,
            "device_tier": dataclasses.asdict(prof.device_tier) if prof.device_tier is not None else None}


def parse(argv: list[str]) -> argparse.Namespace:
    """plan's flags, as `fastdecode plan` parses them (build_profile(parse([...])) gives the profile)."""
    parser = argparse.ArgumentParser(prog="fastdecode")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["plan", *argv])


def main(argv=None) -> int:
    return run(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
