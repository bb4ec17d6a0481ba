"""Stated hardware: a Profile from datasheet figures (a GPU preset, CPU bandwidth and memory,
a link, the S-worker's own KV tier in the GPU's memory), for planning before any machine is at hand.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastdecode.sizing.schema import LinkProfile, ModelDims, Profile, RWorkerProfile, SWorkerProfile, TierProfile
from rworker.protocol.kvformat import PAGE_TOKENS


@dataclass(slots=True)
class GpuSpec:
    """A GPU from its datasheet. S-part time of a layer = a soft max (p-norm, p=8) of the
    compute time at compute_eff of peak and the weight-streaming time at memory_eff of the
    bandwidth, never below a per-layer floor (kernel launches). compute_eff, p and the floor
    are fitted to per-layer times measured on the project's H100 box (max error 4% over B = 64..16384); memory_eff
    is hidden under that floor on the H100 and assumed."""
    name: str
    peak_tflops: float              # dense bf16 tensor-core peak (TFLOP/s)
    mem_bw_GBps: float
    mem_GB: float
    compute_eff: float = 0.62
    memory_eff: float = 0.8
    layer_floor_s: float = 0.245e-3
    # measured S-part per layer for one layer shape: (hidden, intermediate, heads, kv_heads) -> grid
    measured_shape: tuple | None = None
    measured_grid: tuple = ()
    measured_layer_s: tuple = ()

    def gemm_time(self, flops: float, weight_bytes: float) -> float:
        compute = flops / (self.compute_eff * self.peak_tflops * 1e12)
        memory = weight_bytes / (self.memory_eff * self.mem_bw_GBps * 1e9)
        return (compute ** 8 + memory ** 8) ** 0.125

    def layer_time(self, model: ModelDims, batch: int) -> float:
        t = self.gemm_time(model.layer_flops_per_token() * batch, model.layer_weight_bytes())
        return max(t, self.layer_floor_s)

    def head_time(self, model: ModelDims, batch: int) -> float:
        """LM head GEMM plus sampling (about 3 passes over fp32 logits)."""
        gemm = self.gemm_time(2.0 * model.hidden * model.vocab * batch,
                              model.hidden * model.vocab * model.dtype_bytes)
        return gemm + 3 * 4 * batch * model.vocab / (self.memory_eff * self.mem_bw_GBps * 1e9)


_H100_B = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_H100_MS = (0.247, 0.258, 0.245, 0.354, 0.65, 1.308, 2.631, 5.449, 10.592)
GPU_PRESETS = {
    # datasheet: H100 SXM5 80GB, 989 dense bf16 TFLOP/s, 3.35 TB/s; measured grid: one Llama-2-7B-shaped layer on the project's H100 box, 2026-11-22
    "h100": GpuSpec("h100", 989.0, 3350.0, 80.0, measured_shape=(4096, 11008, 32, 32),
                    measured_grid=_H100_B, measured_layer_s=tuple(m * 1e-3 for m in _H100_MS)),
    # datasheet: A10 24GB GDDR6, 125 dense bf16 TFLOP/s (250 with sparsity), 600 GB/s
    "a10": GpuSpec("a10", 125.0, 600.0, 24.0),
    # datasheet: A100 SXM 80GB, 312 dense bf16 TFLOP/s, 2039 GB/s
    "a100": GpuSpec("a100", 312.0, 2039.0, 80.0),
}
DEFAULT_GRID = tuple(2 ** i for i in range(0, 17))     # 1 .. 65536


def s_worker_from_spec(gpu: GpuSpec, model: ModelDims, grid=DEFAULT_GRID) -> SWorkerProfile:
    shape = (model.hidden, model.intermediate, model.heads, model.kv_heads)
    if gpu.measured_shape == shape and model.dtype_bytes == 2:
        grid, layer = list(gpu.measured_grid), list(gpu.measured_layer_s)
    else:
        layer = [gpu.layer_time(model, b) for b in grid]
    return SWorkerProfile(device=gpu.name, batch_grid=list(grid), layer_time_s=layer,
                          head_time_s=[gpu.head_time(model, b) for b in grid],
                          mem_bytes=gpu.mem_GB * 1e9)


def stated_profile(gpu: GpuSpec, model: ModelDims, cpu_bw_GBps: float | None, cpu_mem_GB: float,
                   link_bw_GBps: float = 12.5, link_latency_us: float = 10.0,
                   cpu_attn_eff: float = 0.66, call_overhead_us: float = 20.0,
                   kv_dtype_bytes: float | None = None, mem_reserve: float = 0.10,
                   shared_cost_ratio: float = 1.0, device_tier: TierProfile | None = None) -> Profile:
    """A Profile from stated hardware: one R-worker type per CPU socket with `cpu_bw_GBps` read
    bandwidth of which attention reaches `cpu_attn_eff` (0.66: torch SDPA bf16 on the H100 box,
    docs/design.md, "The sizing model"), and `cpu_mem_GB` of memory less a reserve for the OS and buffers
    (`cpu_bw_GBps` None: no R-worker, a GPU-only engine on `device_tier`).
    A member-token of shared prefix costs `shared_cost_ratio` of a streamed token: 1 unless
    stated (a datasheet does not say how compute-bound the shared pass is)."""
    for what, v in (("cpu bandwidth", 1.0 if cpu_bw_GBps is None else cpu_bw_GBps), ("cpu memory", cpu_mem_GB),
                    ("link bandwidth", link_bw_GBps), ("cpu efficiency", cpu_attn_eff)):
        if not v > 0:
            raise ValueError(f"{what} must be > 0 (got {v})")
    if link_latency_us < 0 or call_overhead_us < 0:
        raise ValueError("latencies must be >= 0")
    if not 0 < shared_cost_ratio <= 1:
        raise ValueError(f"shared cost ratio must be in (0, 1] (got {shared_cost_ratio})")
    if cpu_bw_GBps is None and device_tier is None:
        raise ValueError("no KV anywhere: state a CPU socket (cpu bandwidth) or a device tier")
    rw = [] if cpu_bw_GBps is None else [
        RWorkerProfile(name=f"cpu-socket-{cpu_bw_GBps:g}GBps", seconds_per_kv_byte=1.0 / (cpu_bw_GBps * 1e9 * cpu_attn_eff),
                       call_overhead_s=call_overhead_us * 1e-6,
                       capacity_bytes=cpu_mem_GB * 1e9 * (1 - mem_reserve), page_tokens=PAGE_TOKENS,
                       shared_cost_ratio=shared_cost_ratio)]
    link = LinkProfile(latency_s=link_latency_us * 1e-6, bandwidth_Bps=link_bw_GBps * 1e9)
    tier = "" if device_tier is None else (f"; device tier {device_tier.capacity_bytes / 1e9:.1f} GB at "
                                           f"{device_tier.bandwidth() / 1e9:.0f} GB/s")
    cpu = "no cpu" if cpu_bw_GBps is None else f"cpu {cpu_bw_GBps:g} GB/s x {cpu_attn_eff:g}, {cpu_mem_GB:g} GB"
    return Profile(model=model, s_worker=s_worker_from_spec(gpu, model), r_workers=rw, link=link,
                   kv_dtype_bytes=kv_dtype_bytes or model.dtype_bytes, source="stated", device_tier=device_tier,
                   notes=f"gpu {gpu.name}: {gpu.peak_tflops:g} TFLOP/s, {gpu.mem_bw_GBps:g} GB/s; "
                         f"{cpu}; link {link_bw_GBps:g} GB/s, {link_latency_us:g} us{tier}")


# the S-worker's own KV tier on a stated GPU (engine/kv_tiers.py sizes the real one)
TIER_ATTN_EFF = 0.7              # the paged decode kernel's share of the card's read bandwidth: assumed until measured
TIER_OVERHEAD_US = 10.0          # per attention call: the K/V write and the kernel's launch
GPU_MEMORY_UTILIZATION = 0.9     # generate's --gpu-memory-utilization default
ENGINE_MAX_BATCH, ENGINE_MAX_PREFILL = 4096, (8192, 32768)    # generate's defaults on a GPU (engine/args.py)


def activation_reserve_bytes(model: ModelDims, free_bytes: float, max_batch: int = ENGINE_MAX_BATCH,
                             max_prefill_tokens: int | None = None) -> float:
    """What the engine keeps free for the S-part's activations beside its tier (engine/kv_tiers.py's
    activation_reserve_bytes; torch-free for `plan`): a prefill chunk's (6·hidden + 3·intermediate
    values a token) and the decode rows' with their fp32 logits twice. The chunk is generate's
    default: as many tokens as a quarter of the free memory holds, within 8,192..32,768."""
    per_token = (6 * model.hidden + 3 * model.intermediate) * model.dtype_bytes
    if max_prefill_tokens is None:
        low, high = ENGINE_MAX_PREFILL
        max_prefill_tokens = int(min(high, max(low, free_bytes // 4 // per_token)))
    return max_prefill_tokens * per_token + max_batch * (per_token + 8 * model.vocab)


def stated_tier_bytes(gpu: GpuSpec, model: ModelDims, utilization: float = GPU_MEMORY_UTILIZATION,
                      weight_bytes: float | None = None, max_batch: int = ENGINE_MAX_BATCH,
                      max_prefill_tokens: int | None = None) -> float:
    """The device tier generate sizes by default on this GPU: utilization x its memory, less the
    weights (`weight_bytes`, default the model's own dtype) and the activations' reserve (0 where
    nothing is left)."""
    weights = model.weight_bytes() if weight_bytes is None else weight_bytes
    free = gpu.mem_GB * 1e9 - weights
    reserve = activation_reserve_bytes(model, free, max_batch, max_prefill_tokens)
    return max(utilization * gpu.mem_GB * 1e9 - weights - reserve, 0.0)


def stated_tier(gpu: GpuSpec | None, model: ModelDims, capacity_GB: float | None = None,
                attn_GBps: float | None = None, **sizing) -> TierProfile | None:
    """A device tier from stated figures: `capacity_GB` of KV (default: stated_tier_bytes on `gpu`)
    attended at `attn_GBps` (default: TIER_ATTN_EFF of the GPU's bandwidth); None where nothing
    fits. `sizing`: stated_tier_bytes's options."""
    if (capacity_GB is None or attn_GBps is None) and gpu is None:
        raise ValueError("a device tier needs its size and rate, or a GPU to take them from")
    for what, v in (("device KV size", capacity_GB), ("device KV bandwidth", attn_GBps)):
        if v is not None and not v > 0:
            raise ValueError(f"{what} must be > 0 (got {v})")
    capacity = capacity_GB * 1e9 if capacity_GB is not None else stated_tier_bytes(gpu, model, **sizing)
    if capacity <= 0:
        return None
    rate = attn_GBps * 1e9 if attn_GBps is not None else TIER_ATTN_EFF * gpu.mem_bw_GBps * 1e9
    name = f"device ({gpu.name})" if gpu is not None else "device (stated)"
    return TierProfile(name=name, seconds_per_kv_byte=1.0 / rate, call_overhead_s=TIER_OVERHEAD_US * 1e-6,
                       capacity_bytes=capacity, kind="device", page_tokens=PAGE_TOKENS, frees_windows=False)
