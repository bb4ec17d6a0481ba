"""`fastdecode profile`: measure what the sizing model needs on the machines at hand.

- T_S(B): the S-part of one layer (averaged over all layers, as the engine runs it) and the LM
  head + sampling, over a batch grid on the S-worker's device;
- each R-worker's attention cost: seconds per KV byte and per call (every rank under mpirun);
- the S<->R link: one-way time by message size (echo round trip / 2).
The result is a `fastdecode-profile/1` JSON that `fastdecode plan --profile` reads.
"""
from __future__ import annotations

import platform
import time

import numpy as np
import torch

from .engine import KV_ITEMSIZE, LLMEngine
from .sampler import SamplingBatch, sample
from .sampling_params import SamplingParams
from .sizing import LinkProfile, ModelDims, Profile, RWorkerProfile, SWorkerProfile

CPU_GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
GPU_GRID = [1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384]
LINK_SIZES = [64, 1 << 10, 16 << 10, 256 << 10, 1 << 22, 16 << 20, 64 << 20]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


@torch.inference_mode()
def time_s_part(engine: LLMEngine, batch: int, repeats: int = 3) -> tuple[float, float]:
    """(seconds per layer, seconds for LM head + greedy sampling) at `batch` rows."""
    m, c = engine.model, engine.config
    gen = torch.Generator(device=m.device).manual_seed(batch)
    x = torch.randn(batch, c.hidden_size, device=m.device, generator=gen).to(m.dtype)
    o = torch.randn(batch, c.num_heads, c.head_dim, device=m.device, generator=gen).to(m.dtype)
    positions = torch.randint(0, min(c.max_position, 4096), (batch,), device=m.device, generator=gen)
    cos, sin = m.rope.cos_sin(positions)

    def layers():
        for i in range(c.num_layers):
            m.qkv(i, x, cos, sin)
            m.post_attn(i, x, o)

    rows = SamplingBatch([(SamplingParams(temperature=0, max_tokens=1), 0, 0, 0, None)] * batch, m.device)
    layer_s = _median(layers, m.device, repeats) / c.num_layers
    head_s = _median(lambda: sample(m.logits(x), rows), m.device, repeats)
    return layer_s, head_s


def run_profile(engine: LLMEngine, batches: list[int] | None = None, r_seqs: int = 64,
                r_target_bytes: int = 256 << 20, link_sizes: list[int] | None = None, repeats: int = 3,
                log=print) -> Profile:
    c = engine.config
    grid = sorted(batches or (GPU_GRID if engine.device.type == "cuda" else CPU_GRID))
    layer_s, head_s = [], []
    for b in grid:
        ls, hs = time_s_part(engine, b, repeats)
        layer_s.append(ls)
        head_s.append(hs)
        log(f"S-part  B={b:>6}: {ls * 1e3:8.3f} ms/layer, head {hs * 1e3:8.3f} ms")
    device = (torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda"
              else f"cpu:{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads")
    mem = torch.cuda.get_device_properties(engine.device).total_memory if engine.device.type == "cuda" else 0
    s_worker = SWorkerProfile(device=device, batch_grid=grid, layer_time_s=layer_s, head_time_s=head_s,
                              mem_bytes=float(mem))
    r_raw = engine.backend.profile_workers(r_seqs, r_target_bytes)
    r_workers = []
    for r in r_raw:
        log(f"R-worker rank {r['rank']} ({r['host']}, {r['threads']} threads): {r['bandwidth_GBps']:.2f} GB/s "
            f"attention, {r['call_overhead_s'] * 1e6:.1f} us per call")
        r_workers.append(RWorkerProfile(name=f"rank{r['rank']}@{r['host']}",
                                        seconds_per_kv_byte=r["seconds_per_kv_byte"],
                                        call_overhead_s=r["call_overhead_s"],
                                        capacity_bytes=float(r["capacity_bytes"] or 0), threads=r["threads"]))
    sizes = link_sizes or LINK_SIZES
    one_way = np.array(engine.backend.ping(sizes, repeats=max(repeats, 5)))     # [workers, sizes]
    times = np.median(one_way, axis=0)
    latency = float(times[0])
    span = times[-1] - times[0]
    bandwidth = (sizes[-1] - sizes[0]) / span if span > 0 else 1e15
    log(f"link: {latency * 1e6:.1f} us latency, {bandwidth / 1e9:.2f} GB/s")
    link = LinkProfile(latency_s=latency, bandwidth_Bps=float(bandwidth), message_bytes=list(sizes),
                       message_time_s=[float(t) for t in times] if span > 0 else [])
    act_bytes = torch.finfo(engine.dtype).bits // 8
    dims = ModelDims(name=engine.source.name, num_layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads,
                     kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                     vocab=c.vocab_size, dtype_bytes=act_bytes)
    notes = (f"measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}; S-worker {device}; "
             f"{len(r_workers)} R-worker(s); kv {engine.kv_dtype}")
    return Profile(model=dims, s_worker=s_worker, r_workers=r_workers, link=link,
                   kv_dtype_bytes=KV_ITEMSIZE[engine.kv_dtype], source="measured", notes=notes)
