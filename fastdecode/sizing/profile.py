"""`fastdecode profile`: measure what the sizing model needs on the machines at hand.

- T_S(B): the S-worker's part of one layer and the rest of a step (LM head, sampling, host
  bookkeeping), over a batch grid: on a CPU its busy time in the engine's own decode step on the
  job's R-workers, over short sequences; on a GPU the device's time for the same step (the
  host only queues work there);
- prefill: seconds per prompt token over a prompt-length grid and over a chunk-size grid (the
  engine's prefill);
- each R-worker's attention cost: seconds per call and per KV byte as paid inside the engine's
  decode steps over the first one and two layers (append, MPI, the S-worker beside it), with the
  kernel alone kept for reference (every rank under mpirun), and what the kernel pays per
  member-token of a shared prefix against a streamed token (shared_cost_ratio; 1 where the store
  cannot share);
- the S-worker's own KV tier, where the job has one (the GPU's memory, or a CPU S-worker's own
  store beside R-workers): its attention cost the same way, and its capacity, kept apart from the
  R-workers (`device_tier`);
- the S<->R link: one-way time by message size (echo round trip / 2) to each R-worker, the
  bandwidth to all of them at once, and on a GPU the pinned device<->host copy bandwidth each
  way (PCIe), which every row crosses twice.
The result is a `fastdecode-profile/1` JSON that `fastdecode plan --profile` reads.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fastdecode.engine.llm_engine import LLMEngine
from fastdecode.sizing.link import fit_link
from fastdecode.sizing.measure import (
    MIN_TIMED_S,
    S_PART_MAX_STEPS,
    S_PART_PROMPT,
    pcie_bandwidth,
    prompts_that_fit,
    r_worker_indices,
    time_chain_hop,
    time_prefill_grids,
    time_r_part_in_step,
    time_s_part,
    time_s_part_device,
)
from fastdecode.sizing.schema import LinkProfile, ModelDims, Profile, RWorkerProfile, SWorkerProfile, TierProfile
from rworker.bench import largest_cache_bytes
from rworker.protocol.kvformat import kv_elem_bytes

CPU_GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
GPU_GRID = [1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384]
# one-way message sizes: up to a layer's Q, K, V for a mini-batch of thousands of sequences of a
# 70B-class model (20 KiB per row), tens of MB; the bandwidth is fitted over the large ones
LINK_SIZES = [64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


@dataclass
class ProfileSettings:
    """What a profile times, and how long each timing runs (the defaults: the full profile)."""
    batches: list[int] | None = None         # T_S(B) grid (None: CPU_GRID or GPU_GRID)
    prompt_lens: list[int] | None = None     # prefill table (None: measure.PROMPT_GRID)
    repeats: int = 3                         # timed repetitions (median)
    r_seqs: int = 64                         # sequences per R-worker timing call
    r_bytes: int = 0                         # KV bytes of the long R-worker timing (0: rworker.bench's default)
    link_sizes: list[int] = field(default_factory=lambda: list(LINK_SIZES))
    min_timed_s: float = MIN_TIMED_S         # an S-part or prefill timing repeats until it spans this long


def quick_settings(cuda: bool) -> ProfileSettings:
    """`profile --quick`: three batch sizes, two prompt lengths, one repetition, a quarter of the
    timing spans, an R-worker timing of one cache's worth of KV (at least 64 MiB) and four message
    sizes: rougher figures in under a minute on the 135M model (dev VM). The caller also shortens
    the prefill chunk (QUICK_PREFILL_TOKENS)."""
    return ProfileSettings(batches=[1, 256, 4096] if cuda else [1, 16, 64], prompt_lens=[16, 128],
                           repeats=1, r_seqs=8, r_bytes=max(64 << 20, largest_cache_bytes()),
                           link_sizes=[64, 16 << 10, 1 << 20, 16 << 20], min_timed_s=MIN_TIMED_S / 4)


QUICK_PREFILL_TOKENS = {"cpu": 512, "cuda": 4096}    # --quick's prefill chunk when --max-prefill-tokens is not given


def run_profile(engine: LLMEngine, settings: ProfileSettings | None = None, log=print) -> Profile:
    """Measure the S-worker, every R-worker and the link on the engine's machines (settings: the
    full profile's unless given)."""
    st = settings or ProfileSettings()
    s_worker = profile_s_worker(engine, st.batches, st.repeats, st.prompt_lens, log, st.min_timed_s)
    r_workers, tier = profile_workers(engine, st.r_seqs, st.r_bytes, log)
    link = profile_link(engine, st.link_sizes, st.repeats, log)
    c = engine.config
    shape = ModelDims.from_hf_config(c.hf_config, engine.source.name) if c.hf_config else None
    dims = ModelDims(name=engine.source.name, num_layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads,
                     kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     intermediate=shape.intermediate if shape else c.intermediate_size,
                     vocab=c.vocab_size, dtype_bytes=torch.finfo(engine.dtype).bits // 8,
                     windows=engine.variants.windows, experts_stored=shape.experts_stored if shape else 0.0)
    notes = (f"measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}; S-worker {s_worker.device}; "
             f"{len(r_workers)} R-worker(s)" + (f"; its own KV tier {tier.name}" if tier else "; no S-worker tier")
             + f"; kv {engine.kv_dtype}")
    prof = Profile(model=dims, s_worker=s_worker, r_workers=r_workers, link=link,
                   kv_dtype_bytes=kv_elem_bytes(engine.kv_dtype, c.head_dim), source="measured", notes=notes,
                   device_tier=tier)
    link.hop_s = time_chain_hop(engine, prof, log=log)
    prof.cores_shared = shared_cores_note(engine, platform.node())
    if prof.cores_shared:
        log(f"warning: {prof.cores_shared}")
    return prof


def shared_cores_note(engine: LLMEngine, node: str) -> str:
    """Where the job's ranks on the S-worker's node outnumber its physical cores, why plans from
    this profile run fast: it times the S-part and each R-worker alone, each with the cores to
    itself, while a job's step runs them at once on those cores. "" where each rank has a core."""
    from rworker.host.threads import physical_cpus
    ranks_here, cores = (engine.layout[0] if engine.layout else 1), len(physical_cpus())
    if ranks_here <= cores:
        return ""
    return (f"the {ranks_here} ranks on {node} share its {cores} physical cores: the profile timed the S-part and "
            f"each R-worker alone, but a job's steps run them at once on these cores, so a job here runs slower "
            f"than plans from this profile say, by more than their fidelity range (2x on a 2-core machine with 3 "
            f"ranks); a profile cannot measure that: profile and run with a core per rank")


def s_part_grid(engine: LLMEngine, batches: list[int] | None, log=None) -> list[int]:
    """The batch sizes T_S(B) is timed at: on a CPU S-worker as far as the R-workers' memory holds
    the timing's sequences (it runs on them); `log` hears of those left out."""
    grid = sorted(batches or (GPU_GRID if engine.device.type == "cuda" else CPU_GRID))
    if engine.device.type == "cuda":
        return grid
    fit = prompts_that_fit(engine, S_PART_PROMPT + 2 + S_PART_MAX_STEPS, r_workers_only=True)
    if grid[0] > fit:
        raise ValueError(f"the R-workers' memory holds {fit} sequences of the S-part timing, fewer than "
                         f"B={grid[0]} (--rworker-mem too small for --batches)")
    if grid[-1] > fit and log is not None:
        log(f"S-part  B={','.join(str(b) for b in grid if b > fit)} left out: the R-workers' memory "
            f"holds {fit} sequences (--rworker-mem)")
    return [b for b in grid if b <= fit]


def profile_s_worker(engine: LLMEngine, batches: list[int] | None, repeats: int,
                     prompt_lens: list[int] | None, log, min_timed_s: float = MIN_TIMED_S) -> SWorkerProfile:
    """T_S(B) over the batch grid (as far as the R-workers' memory holds the timing's sequences
    on a CPU S-worker), and the prefill tables."""
    cuda = engine.device.type == "cuda"
    grid = s_part_grid(engine, batches, log)
    layer_s, head_s = [], []
    for b in grid:
        ls, hs = time_s_part_device(engine, b, repeats) if cuda else time_s_part(engine, b, repeats, min_timed_s)
        layer_s.append(ls)
        head_s.append(hs)
        log(f"S-part  B={b:>6}: {ls * 1e3:8.3f} ms/layer, head {hs * 1e3:8.3f} ms")
    prefill = time_prefill_grids(engine, prompt_lens, log, min_timed_s)
    device = (torch.cuda.get_device_name(engine.device) if cuda
              else f"cpu:{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads")
    mem = torch.cuda.get_device_properties(engine.device).total_memory if cuda else 0
    return SWorkerProfile(device=device, batch_grid=grid, layer_time_s=layer_s, head_time_s=head_s,
                          mem_bytes=float(mem), quantization="fp8" if engine.model.fp8 else "", **prefill)


def profile_workers(engine: LLMEngine, r_seqs: int, r_target_bytes: int, log
                    ) -> tuple[list[RWorkerProfile], TierProfile | None]:
    """Each R-worker's kernel timed alone, and its cost inside the decode step (what the model
    uses); the same for the S-worker's own KV tier where the job has one (the backend's last
    worker, told by its `tier`), kept apart: (R-workers, the tier or None)."""
    workers = engine.backend.workers
    raw = engine.backend.profile_workers(r_seqs, r_target_bytes)
    in_step = time_r_part_in_step(engine, r_seqs, r_target_bytes or max(r["samples"][-1][0] for r in raw))
    rs = r_worker_indices(engine)
    r_workers, tier = [], None
    for i, r in enumerate(raw):
        per_byte, per_call = in_step[i] if in_step else (r["seconds_per_kv_byte"], r["call_overhead_s"])
        step = f"; in the decode step {1e-9 / per_byte:.2f} GB/s, {per_call * 1e6:.1f} us per call" if in_step else ""
        if i not in rs:
            log(f"S-worker's own KV tier {workers[i].tier}: kernel alone {r['bandwidth_GBps']:.2f} GB/s, "
                f"{r['call_overhead_s'] * 1e6:.1f} us per call{step}; {r['capacity_bytes'] / 2**30:.2f} GiB")
            tier = TierProfile(name=workers[i].tier, seconds_per_kv_byte=per_byte, call_overhead_s=per_call,
                               capacity_bytes=float(r["capacity_bytes"] or 0), kind=engine.tier.kind,
                               page_tokens=int(workers[i].page_tokens), frees_windows=bool(workers[i].frees_windows),
                               kernel_seconds_per_kv_byte=r["seconds_per_kv_byte"])
            continue
        log(f"R-worker rank {r['rank']} ({r['host']}, {r['threads']} threads): kernel alone "
            f"{r['bandwidth_GBps']:.2f} GB/s, {r['call_overhead_s'] * 1e6:.1f} us per call{step}"
            + (f"; a member-token of shared prefix costs {r['shared_cost_ratio']:.2f} of a streamed token"
               if "shared_cost_ratio" in r else ""))
        r_workers.append(RWorkerProfile(name=f"rank{r['rank']}@{r['host']}", seconds_per_kv_byte=per_byte,
                                        call_overhead_s=per_call,
                                        capacity_bytes=float(r["capacity_bytes"] or 0), threads=r["threads"],
                                        kernel_seconds_per_kv_byte=r["seconds_per_kv_byte"],
                                        page_tokens=int(workers[i].page_tokens),
                                        shared_cost_ratio=float(r.get("shared_cost_ratio", 1.0)),
                                        shared_seconds_per_kv_byte=float(r.get("shared_seconds_per_kv_byte", 0.0))))
    return r_workers, tier


def profile_link(engine: LLMEngine, sizes: list[int], repeats: int, log) -> LinkProfile:
    """One-way message times S <-> R by size to each R-worker alone (every worker's table kept:
    links can differ per node), the headline figures the slowest worker's (at the largest size),
    and with several R-workers the bandwidth to all of them at once over the two largest sizes
    (what the S-worker's own path carries); on a GPU the device's copy bandwidth each way. In
    local mode there is no link: nothing is tabulated."""
    sizes = sorted(sizes)
    rounds = max(repeats, 5)
    rs = r_worker_indices(engine)              # the S-worker's own tier puts nothing on the link
    one_way = np.array(engine.backend.ping(sizes, repeats=rounds))[rs]     # [R-workers, sizes]
    measured = bool(len(one_way)) and float(one_way[:, -1].max()) > float(one_way[:, 0].min())
    d2h, h2d = pcie_bandwidth(engine.device)
    if d2h:
        log(f"device<->host copies: {d2h / 1e9:.1f} GB/s to the host, {h2d / 1e9:.1f} GB/s to the device")
    if not measured:
        log("link: none (the R-part runs in this process)")
        return LinkProfile(latency_s=float(one_way[0, 0]) if len(one_way) else 0.0, bandwidth_Bps=1e15,
                           device_d2h_Bps=d2h, device_h2d_Bps=h2d)
    names = [f"rank{engine.backend.workers[i].rank}@{engine.backend.workers[i].host}" for i in rs]
    fits = [fit_link(sizes, list(row)) for row in one_way]          # [workers] (latency, bandwidth)
    for name, (lat, bw), row in zip(names, fits, one_way):
        log(f"link to {name}: {lat * 1e6:.1f} us latency, {bw / 1e9:.3f} GB/s; "
            f"{sizes[-1] / 2**20:.0f} MiB one way in {row[-1] * 1e3:.2f} ms")
    slowest = int(np.argmax(one_way[:, -1]))        # LinkProfile.slowest_worker
    concurrent = 0.0
    if len(names) > 1:
        top = sizes[-2:]
        together = engine.backend.ping_all(top, repeats=rounds)     # [2] one-way, all workers at once
        span = together[-1] - together[0]
        concurrent = len(names) * (top[-1] - top[0]) / span if span > 0 else 1e15
        log(f"link to all {len(names)} R-workers at once: {concurrent / 1e9:.3f} GB/s in all "
            f"({sum(bw for _, bw in fits) / 1e9:.3f} GB/s the links alone add up to)")
    log(f"link: the slowest is {names[slowest]}'s")
    return LinkProfile(latency_s=fits[slowest][0], bandwidth_Bps=fits[slowest][1], message_bytes=list(sizes),
                       message_time_s=[float(t) for t in one_way[slowest]], device_d2h_Bps=d2h, device_h2d_Bps=h2d,
                       worker_names=names, worker_message_time_s=[[float(t) for t in row] for row in one_way],
                       worker_latency_s=[f[0] for f in fits], worker_bandwidth_Bps=[f[1] for f in fits],
                       concurrent_Bps=float(concurrent))
