"""The S-worker over T GPUs (`--tensor-parallel-size T`) and with fp8 weights (`--quantization
fp8`) in the sizing model: the S-part of one GPU in the profile becomes that of T ranks, each
holding 1/T of every projection (docs/design.md, "The tensor-parallel S-worker").

Per layer and mini-batch of B rows, a rank runs 1/T of the GEMMs and waits on
    2 all-reduces of B x hidden values       (after O and after the MLP)
    a gather of Q, K, V and a scatter of O   (rank 0 assembles every head for the R-workers)
each over the GPUs' interconnect, timed as NCCL's ring: latency + 2 (T-1)/T x bytes / bus bandwidth
for an all-reduce, latency + (T-1)/T x bytes / bandwidth for a gather or scatter at rank 0. The
LM head's vocabulary is split too, its logits gathered on rank 0, which samples alone.

fp8: from stated hardware the GEMMs run at the card's fp8 peak (`FP8_TFLOPS`) with the same
efficiency as bf16's, read 1 byte per weight, and quantize their inputs per token (one pass over
each GEMM's input); a card without fp8 GEMMs dequantizes every weight before its GEMM (read the
e4m3 weight, write and read a bf16 copy). A profile measured in bf16 is scaled by `fp8_speedup`
(stated: the layer's bf16 time over its fp8 time); one measured with `--quantization fp8` is
fp8's already. A measured layer split over T ranks takes 1/T of its time, never less than a
GPU's kernel-launch floor. A profile is always one S-rank's (`fastdecode profile` refuses T > 1):
the collectives come from the stated link (`--tp-interconnect`, `--tp-link-gbps`,
`--tp-link-latency`), not a measurement.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastdecode.sizing.hardware import GpuSpec, s_worker_from_spec, stated_tier
from fastdecode.sizing.schema import ModelDims, Profile, SWorkerProfile, TierProfile

# all-reduce bus bandwidth (GB/s, what NCCL's ring reaches on large messages) and latency per
# collective (us) between the GPUs of one node: stated figures, not measured here
INTERCONNECTS = {"nvlink": (360.0, 10.0),       # H100 SXM, NVLink 4 (450 GB/s each way per GPU)
                 "pcie": (25.0, 20.0)}          # GPUs without NVLink, PCIe 5 through the host
FP8_TFLOPS = {"h100": 1979.0, "h200": 1979.0}   # dense fp8 peaks (datasheets); a100 and a10 have no fp8 GEMMs
FP8_SPEEDUP = 1.6         # a bf16-measured layer's time over fp8's, where nothing better is known (stated)
LAUNCH_FLOOR_S = GpuSpec("", 1.0, 1.0, 1.0).layer_floor_s      # a GPU layer's kernel launches


@dataclass(frozen=True)
class TPSizing:
    size: int = 1                       # T: S-ranks (GPUs)
    fp8: bool = False                   # fp8 projection weights
    interconnect: str = "nvlink"
    allreduce_GBps: float = INTERCONNECTS["nvlink"][0]
    latency_us: float = INTERCONNECTS["nvlink"][1]
    fp8_speedup: float = FP8_SPEEDUP

    @property
    def active(self) -> bool:
        return self.size > 1 or self.fp8

    def describe(self) -> str:
        parts = [(f"{self.size} GPUs, tensor-parallel over {self.interconnect} ({self.allreduce_GBps:g} GB/s, "
                  f"{self.latency_us:g} us a collective)")] if self.size > 1 else []
        return ", ".join(parts + (["fp8 weights"] if self.fp8 else []))


def fp8_peak(gpu: GpuSpec) -> float:
    """The card's dense fp8 TFLOP/s (a GPU JSON may state `fp8_tflops`); 0: no fp8 GEMMs."""
    return float(getattr(gpu, "fp8_tflops", 0.0) or FP8_TFLOPS.get(gpu.name, 0.0))


def allreduce_s(nbytes: float, t: TPSizing) -> float:
    return 0.0 if t.size <= 1 else t.latency_us * 1e-6 + 2 * (t.size - 1) / t.size * nbytes / (t.allreduce_GBps * 1e9)


def to_rank0_s(nbytes: float, t: TPSizing) -> float:
    """A gather at (or scatter from) rank 0 of `nbytes` in all: the other ranks' (T-1)/T."""
    return 0.0 if t.size <= 1 else t.latency_us * 1e-6 + (t.size - 1) / t.size * nbytes / (t.allreduce_GBps * 1e9)


def layer_comm_s(model: ModelDims, rows: float, t: TPSizing) -> float:
    """One layer's collectives for `rows` rows: 2 all-reduces of rows x hidden, the Q/K/V gather
    and the O scatter."""
    act = model.dtype_bytes
    return (2 * allreduce_s(rows * model.hidden * act, t) + to_rank0_s(rows * model.to_rworker_bytes_per_token(), t)
            + to_rank0_s(rows * model.from_rworker_bytes_per_token(), t))


def weight_bytes_per_gpu(model: ModelDims, t: TPSizing) -> float:
    """A rank's weights: 1/T of the projections (1 byte each in fp8), 1/T of the LM head, the
    whole embedding (every rank looks tokens up)."""
    layers = model.num_layers * model.layer_weight_bytes() * (1 / model.dtype_bytes if t.fp8 else 1)
    table = model.vocab * model.hidden * model.dtype_bytes
    return layers / t.size + table / t.size + table


def stated_layer_s(gpu: GpuSpec, model: ModelDims, rows: float, t: TPSizing) -> float:
    """A rank's dense work of one layer from the datasheet (GpuSpec's soft maximum of compute and
    weight streaming, its launch floor), fp8 as the module says; collectives not included."""
    flops = model.layer_flops_per_token() * rows / t.size
    weights = model.layer_weight_bytes() / model.dtype_bytes / t.size          # elements
    bw = gpu.memory_eff * gpu.mem_bw_GBps * 1e9
    extra = 0.0
    peak = gpu.peak_tflops
    if t.fp8 and fp8_peak(gpu):
        peak, weight_bytes = fp8_peak(gpu), weights
        inputs = rows * (2 * model.hidden + model.heads * model.head_dim / t.size + model.intermediate / t.size)
        extra = inputs * (model.dtype_bytes + 1) / bw                             # per-token quantization
    elif t.fp8:
        weight_bytes = weights * model.dtype_bytes
        extra = weights * (1 + 2 * model.dtype_bytes) / bw                        # dequantized before each GEMM
    else:
        weight_bytes = weights * model.dtype_bytes
    compute = flops / (gpu.compute_eff * peak * 1e12)
    memory = weight_bytes / bw
    return max((compute ** 8 + memory ** 8) ** 0.125 + extra, gpu.layer_floor_s)


def head_s(gpu: GpuSpec, model: ModelDims, rows: float, t: TPSizing) -> float:
    """A rank's LM head (1/T of the vocabulary), the logits' gather and rank 0's sampling (about 3
    passes over fp32 logits), from the datasheet."""
    gemm = gpu.gemm_time(2.0 * model.hidden * model.vocab * rows / t.size, model.hidden * model.vocab *
                         model.dtype_bytes / t.size)
    sampling = 3 * 4 * rows * model.vocab / (gpu.memory_eff * gpu.mem_bw_GBps * 1e9)
    return gemm + to_rank0_s(rows * model.vocab * model.dtype_bytes, t) + sampling


def tensor_parallel_s_worker(s: SWorkerProfile, model: ModelDims, t: TPSizing,
                             gpu: GpuSpec | None = None) -> SWorkerProfile:
    """The S-part of T ranks (and fp8) from one GPU's: from the datasheet where `gpu` is given,
    else the measured times scaled (1/T, fp8's speed-up unless measured in fp8), plus the
    collectives."""
    if not t.active:
        return s
    grid = list(s.batch_grid)
    measured_fp8 = s.quantization == "fp8"
    scale = 1.0 / t.fp8_speedup if t.fp8 and not measured_fp8 else 1.0
    floor = LAUNCH_FLOOR_S if not s.device.startswith("cpu") else 0.0
    if gpu is not None:
        dense = [stated_layer_s(gpu, model, b, t) for b in grid]
    else:
        dense = [max(x * scale / t.size, min(floor, x * scale)) for x in s.layer_time_s]
    if gpu is not None:
        heads = [head_s(gpu, model, b, t) for b in grid]
    else:
        heads = [h / t.size + to_rank0_s(b * model.vocab * model.dtype_bytes, t) for h, b in zip(s.head_time_s, grid)]
    # a prefill token's share of its chunk's collectives (bandwidth only: a chunk is thousands of
    # rows): the 2 all-reduces and its K, V gathered for the R-workers, every layer
    others = (t.size - 1) / t.size
    per_token = model.num_layers * others * (4 * model.hidden + 2 * model.kv_heads * model.head_dim) * \
        model.dtype_bytes / (t.allreduce_GBps * 1e9)
    return dataclasses.replace(
        s, device=f"{s.device} ({t.describe()})", batch_grid=grid,
        layer_time_s=[d + layer_comm_s(model, b, t) for d, b in zip(dense, grid)],
        head_time_s=heads,
        prefill_token_s=[x * scale / t.size + per_token for x in s.prefill_token_s],
        prefill_chunk_token_s=[x * scale / t.size + per_token for x in s.prefill_chunk_token_s])


def with_tensor_parallel(prof: Profile, t: TPSizing, gpu: GpuSpec | None = None) -> Profile:
    """`prof` with its S-worker over t.size GPUs (and fp8); unchanged at T = 1 in bf16."""
    if not t.active:
        return prof
    base = s_worker_from_spec(gpu, prof.model) if gpu is not None else prof.s_worker
    return dataclasses.replace(prof, s_worker=tensor_parallel_s_worker(base, prof.model, t, gpu))


def stated_tier_over(gpu: GpuSpec | None, model: ModelDims, t: TPSizing, capacity_GB: float | None = None,
                     attn_GBps: float | None = None, **sizing) -> TierProfile | None:
    """The S-worker's own KV tier over T GPUs (hardware.stated_tier's figures, stated ones for all
    T together): each rank keeps its own heads' pages in its memory beside its weights (1/T of
    them, 1 byte each in fp8) and attends them, so T ranks hold T tiers' bytes at T tiers' rate."""
    if not t.active:
        return stated_tier(gpu, model, capacity_GB, attn_GBps, **sizing)
    per_gpu = stated_tier(gpu, model, None if capacity_GB is None else capacity_GB / t.size,
                          None if attn_GBps is None else attn_GBps / t.size,
                          **{"weight_bytes": weight_bytes_per_gpu(model, t), **sizing})
    if per_gpu is None or t.size == 1:
        return per_gpu
    return dataclasses.replace(per_gpu, name=f"{per_gpu.name} x{t.size}", capacity_bytes=per_gpu.capacity_bytes * t.size,
                               seconds_per_kv_byte=per_gpu.seconds_per_kv_byte / t.size)


def sizing_from_args(args) -> TPSizing:
    """plan's and simulate's flags (add_options) -> TPSizing; ValueError naming a bad one."""
    size = getattr(args, "tensor_parallel_size", None)
    size = 1 if size is None else size
    link = getattr(args, "tp_interconnect", "nvlink") or "nvlink"
    bw, lat = INTERCONNECTS[link]
    bw = args.tp_link_gbps if getattr(args, "tp_link_gbps", None) is not None else bw
    lat = args.tp_link_latency if getattr(args, "tp_link_latency", None) is not None else lat
    speedup = getattr(args, "fp8_speedup", None) or FP8_SPEEDUP
    for flag, v, lo in (("--tensor-parallel-size", size, 1), ("--tp-link-gbps", bw, 1e-9),
                        ("--tp-link-latency", lat, 0.0), ("--fp8-speedup", speedup, 1e-9)):
        if not lo <= v < float("inf"):
            raise ValueError(f"{flag} must be a finite number >= {lo:g} (got {v})")
    return TPSizing(int(size), getattr(args, "quantization", None) == "fp8", link, float(bw), float(lat),
                    float(speedup))


def add_options(p) -> None:
    """The flags plan and simulate take for a tensor-parallel or fp8 S-worker, and for several S-worker
    groups (the first three as generate's)."""
    from fastdecode.engine_options import add_data_parallel_size, add_quantization, add_tensor_parallel_size
    g = p.add_argument_group("S-worker over several GPUs, several S-workers, fp8 weights")
    add_tensor_parallel_size(g)
    add_data_parallel_size(g)
    add_quantization(g)
    g.add_argument("--tp-interconnect", choices=sorted(INTERCONNECTS), default="nvlink",
                   help="the GPUs' link for the all-reduces: " + ", ".join(
                       f"{k} {bw:g} GB/s, {lat:g} us" for k, (bw, lat) in INTERCONNECTS.items())
                   + " (stated; default %(default)s)")
    g.add_argument("--tp-link-gbps", type=float, default=None, metavar="GBPS",
                   help="all-reduce bus bandwidth between the S-ranks' GPUs, GB/s (default: the interconnect's)")
    g.add_argument("--tp-link-latency", type=float, default=None, metavar="US",
                   help="latency of one collective, us (default: the interconnect's)")
    g.add_argument("--fp8-speedup", type=float, default=None, metavar="X",
                   help=f"a measured bf16 layer's time over its fp8 time (default {FP8_SPEEDUP}, stated)")
