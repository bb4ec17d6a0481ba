"""The hardware and model flags of `fastdecode plan` and `fastdecode simulate`: a measured profile,
stated hardware, or both (stated flags replace those parts of the profile)."""
from __future__ import annotations

import argparse

from fastdecode.engine_options import Renamed, bytes_arg
from fastdecode.sizing.hardware import GPU_PRESETS, TIER_ATTN_EFF
from fastdecode.sizing.schema import MODEL_PRESETS
from fastdecode.sizing.tensor_parallel import add_options as add_tp_options

# stated hardware where a flag is not given (a measured profile's own values win over these)
STATED_CPU_MEM_GB, STATED_LINK_BW_GBPS, STATED_LINK_LATENCY_US, STATED_OVERHEAD_US = 256.0, 12.5, 10.0, 20.0


def add_hardware_options(p: argparse.ArgumentParser):
    """The hardware and model flags (a profile, stated hardware, or both): plan's and simulate's."""
    measured = "the profile's measurement; stated hardware: "
    src = p.add_argument_group("hardware and model")
    src.add_argument("--profile", help="profile JSON written by `fastdecode profile` (default: none: stated "
                                       "hardware)")
    src.add_argument("--gpu-profile", help=f"GPU preset ({', '.join(GPU_PRESETS)}) or a JSON file "
                     "with name, peak_tflops, mem_bw_GBps, mem_GB (default: the profile's S-worker)")
    src.add_argument("--model", help=f"model preset ({', '.join(MODEL_PRESETS)}), an HF config.json or model "
                                     "directory, or an org/name in the local HF cache (default: the profile's model)")
    src.add_argument("--cpu-bw", type=float, help="read bandwidth of one R-worker (CPU socket), GB/s "
                                                  "(default: the profile's measurement; needed without one)")
    src.add_argument("--rworker-mem", type=bytes_arg, metavar="SIZE",
                     help=f"KV memory of one R-worker, as generate's flag (215G; bytes without a unit; default: "
                          f"{measured}{STATED_CPU_MEM_GB:g} GB less 10%%)")
    src.add_argument("--cpu-mem", action=Renamed, nargs="?", help=argparse.SUPPRESS,
                     new="--rworker-mem SIZE (215G: the KV memory of one R-worker, generate's flag and units)")
    src.add_argument("--cpu-eff", type=float, default=0.66,
                     help="fraction of --cpu-bw the attention kernel reaches (default: %(default)s)")
    src.add_argument("--rworker-overhead-us", type=float,
                     help=f"fixed cost per attention call, us (default: {measured}{STATED_OVERHEAD_US:g})")
    src.add_argument("--shared-cost-ratio", type=float, metavar="X",
                     help=f"what a member-token of shared prefix costs an R-worker against a streamed KV "
                          f"token, in (0, 1] (default: {measured}1, as streamed)")
    src.add_argument("--link-bw", type=float,
                     help=f"S<->R link bandwidth, GB/s (default: {measured}{STATED_LINK_BW_GBPS:g})")
    src.add_argument("--link-latency", type=float,
                     help=f"S<->R one-way latency, us (default: {measured}{STATED_LINK_LATENCY_US:g})")
    src.add_argument("--device-kv", action=argparse.BooleanOptionalAction, default=True,
                     help="the S-worker's own KV tier, as generate's flag: the profile's, or on a stated GPU "
                          "what its memory holds beside the weights (default); --no-device-kv plans all KV on "
                          "the R-workers")
    src.add_argument("--device-kv-memory", type=bytes_arg, metavar="SIZE",
                     help="KV memory of the S-worker's own tier, as generate's flag (40G; bytes without a unit; "
                          "default: the profile's measurement; a stated GPU: 0.9 of its memory less the weights "
                          "and the activations' reserve, generate's default)")
    src.add_argument("--device-kv-gb", action=Renamed, nargs="?", help=argparse.SUPPRESS,
                     new="--device-kv-memory SIZE (40G: binary units, as generate's)")
    src.add_argument("--device-kv-gbps", type=float, metavar="GB/S",
                     help="KV read rate of the tier's attention, GB/s (default: the profile's measurement; a "
                          f"stated GPU: {TIER_ATTN_EFF:g} of its memory bandwidth)")
    add_tp_options(p)
    return src


def stated_memory(args) -> tuple[float, float]:
    """(an R-worker's memory in GB, the share of it kept from KV) for stated hardware: --rworker-mem
    is KV memory already; the default is a machine's, less 10%."""
    return (args.rworker_mem / 1e9, 0.0) if args.rworker_mem is not None else (STATED_CPU_MEM_GB, 0.10)
