"""Stated hardware: a Profile from datasheet figures (a GPU preset, CPU bandwidth and memory,
a link), for planning before any machine is at hand.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastdecode.sizing.schema import LinkProfile, ModelDims, Profile, RWorkerProfile, SWorkerProfile
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


def stated_profile(gpu: GpuSpec, model: ModelDims, cpu_bw_GBps: float, cpu_mem_GB: float,
                   link_bw_GBps: float = 12.5, link_latency_us: float = 10.0,
                   cpu_attn_eff: float = 0.66, call_overhead_us: float = 20.0,
                   kv_dtype_bytes: float | None = None, mem_reserve: float = 0.10,
                   shared_cost_ratio: float = 1.0) -> Profile:
    """A Profile from stated hardware: one R-worker type per CPU socket with `cpu_bw_GBps` read
    bandwidth of which attention reaches `cpu_attn_eff` (0.66: torch SDPA bf16 on the H100 box,
    docs/design.md, "The sizing model"), and `cpu_mem_GB` of memory less a reserve for the OS and buffers.
    A member-token of shared prefix costs `shared_cost_ratio` of a streamed token: 1 unless
    stated (a datasheet does not say how compute-bound the shared pass is)."""
    for what, v in (("cpu bandwidth", cpu_bw_GBps), ("cpu memory", cpu_mem_GB),
                    ("link bandwidth", link_bw_GBps), ("cpu efficiency", cpu_attn_eff)):
        if not v > 0:
            raise ValueError(f"{what} must be > 0 (got {v})")
    if link_latency_us < 0 or call_overhead_us < 0:
        raise ValueError("latencies must be >= 0")
    if not 0 < shared_cost_ratio <= 1:
        raise ValueError(f"shared cost ratio must be in (0, 1] (got {shared_cost_ratio})")
    rw = RWorkerProfile(name=f"cpu-socket-{cpu_bw_GBps:g}GBps",
                        seconds_per_kv_byte=1.0 / (cpu_bw_GBps * 1e9 * cpu_attn_eff),
                        call_overhead_s=call_overhead_us * 1e-6,
                        capacity_bytes=cpu_mem_GB * 1e9 * (1 - mem_reserve), page_tokens=PAGE_TOKENS,
                        shared_cost_ratio=shared_cost_ratio)
    link = LinkProfile(latency_s=link_latency_us * 1e-6, bandwidth_Bps=link_bw_GBps * 1e9)
    return Profile(model=model, s_worker=s_worker_from_spec(gpu, model), r_workers=[rw], link=link,
                   kv_dtype_bytes=kv_dtype_bytes or model.dtype_bytes, source="stated",
                   notes=f"gpu {gpu.name}: {gpu.peak_tflops:g} TFLOP/s, {gpu.mem_bw_GBps:g} GB/s; "
                         f"cpu {cpu_bw_GBps:g} GB/s x {cpu_attn_eff:g}, {cpu_mem_GB:g} GB; "
                         f"link {link_bw_GBps:g} GB/s, {link_latency_us:g} us")

