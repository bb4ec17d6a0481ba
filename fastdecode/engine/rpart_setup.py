"""A job's R-part from the engine's side: which backends hold the KV (local mode's store or the
R-workers, and beside them the S-worker's own tier), placement's speeds across tiers and what it
learns of the S-part per step, and what the start-up lines, the run summary and an out-of-memory
error say about them. The engine (llm_engine.py) calls these once at start-up and once per step.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from fastdecode.engine.kv_tiers import (
    TierChoice,
    activation_reserve_bytes,
    device_tier_bytes,
    gib,
    measured_speeds,
)
from fastdecode.rpart.base import RBackend
from fastdecode.rpart.tiered import TieredBackend


class OutOfMemory(RuntimeError):
    """A step's allocation failed: the message says where and which limits to lower."""


def make_backend(eng, comm, parallel=None) -> tuple[RBackend, object, TierChoice]:
    """The R-part: local mode's in-process store, or the R-workers over MPI; beside either,
    the S-worker's own KV tier where the job has one (engine/kv_tiers.py). -> (the backend, the
    model's attention variants, the tier as built: a tier too small on the device is none). `eng`
    is what assembly.build_spart made. A tensor-parallel S-worker (eng.tp) reaches the R-workers
    the way `parallel` says (fastdecode/tp: rank 0 gathers the heads), each S-rank holding the
    tier's pages of its own heads (rpart/sharded_tier.py)."""
    from fastdecode.rpart.variants import AttentionVariants
    variants = AttentionVariants.of(eng.config, eng.model)
    tp = eng.tp
    others = _other_workers(eng, comm, variants, parallel)
    tier_config = eng.model.config                   # a tensor-parallel rank's: its own heads
    if eng.tier.kind == "device":
        from fastdecode.rpart.device_kv import DeviceKVTier, page_bytes
        reserve = activation_reserve_bytes(eng.config, eng.dtype, eng.args.max_prefill_tokens,
                                           eng.args.max_batch)
        size = device_tier_bytes(eng.tier.capacity_bytes, eng.args.gpu_memory_utilization, eng.device,
                                 reserve)
        size = tp.group.min_int(size) if tp is not None else size      # every rank's tier alike
        page = others.workers[0].page_tokens
        if size < 2 * page_bytes(tier_config, eng.kv_dtype, page):
            return others, variants, TierChoice("", 0, f"{gib(size)} free on {eng.device}: too little for a KV tier")
        tier = DeviceKVTier(tier_config, eng.kv_dtype, size, eng.device, variants, page_tokens=page)
    elif eng.tier.kind == "local":
        from fastdecode.rpart.local import LocalBackend
        size = tp.group.min_int(eng.tier.capacity_bytes) if tp is not None else eng.tier.capacity_bytes
        tier = LocalBackend(tier_config, eng.kv_dtype, eng.args.s_threads or eng.s_cores, size, asynchronous=False,
                            bf16_probs=eng.args.attn_probs == "bf16", variants=variants)
        tier.workers[0].tier = "local (in-process store)"
    else:
        if tp is not None:
            tp.group.min_int(0)                      # the ranks agree on no tier as on a size
        return others, variants, eng.tier
    if tp is not None:
        from fastdecode.rpart.sharded_tier import ShardedTier
        tier = ShardedTier(tier, tp.size)
    return TieredBackend(others, tier), variants, eng.tier


def _other_workers(eng, comm, variants, parallel) -> RBackend:
    """The workers beside the tier: local mode's store or the R-workers (ranks T.. under a
    tensor-parallel S-worker of T ranks, reached as `parallel` says)."""
    tp = eng.tp
    s_ranks = tp.size if tp is not None else 1
    if tp is not None and tp.rank > 0:
        return parallel.workers(eng, comm, None)
    bf16_probs = eng.args.attn_probs == "bf16"
    if comm is None or comm.Get_size() <= s_ranks:
        from fastdecode.rpart.local import LocalBackend
        from rworker.host.threads import physical_cpus
        cores = len(physical_cpus())
        r_threads = eng.args.r_threads or (max(1, cores - eng.s_cores) if eng.args.pipeline_depth > 1
                                            else cores)
        others = LocalBackend(eng.config, eng.kv_dtype, r_threads, eng.args.rworker_mem,
                              asynchronous=eng.args.pipeline_depth > 1, bf16_probs=bf16_probs, variants=variants)
    else:
        from fastdecode.rpart.mpi import MPIBackend
        from rworker.host.wait import choose_policy
        ranks_here = eng.layout[0]
        policy = choose_policy(ranks_here, ranks_here)
        local_kv = eng.tier.capacity_bytes if eng.tier.kind == "local" else 0
        others = MPIBackend(comm, eng.config, eng.kv_dtype, variants, eng.args.r_threads,
                            eng.args.rworker_mem, policy, eng.args.timeout, eng.device, eng.dtype,
                            s_cores=eng.s_cores, bf16_probs=bf16_probs, s_kv_bytes=local_kv,
                            ranks=range(s_ranks, comm.Get_size()), link_rows=eng.args.max_batch or 0)
    return others if tp is None else parallel.workers(eng, comm, others)


def log_tiers(eng) -> None:
    """One line naming where KV lives: the S-worker's own tier and the R-workers, with capacities."""
    workers = eng.backend.workers
    others = [w for w in workers if not w.tier]
    kind = "R-workers" if eng.layout is not None else "host store"
    held = gib(sum(w.capacity_bytes for w in others))
    parts = [f"{len(others)} {kind if len(others) != 1 else kind.rstrip('s')} up to {held}"]
    if eng.tier_index is not None:
        t = workers[eng.tier_index]
        parts.insert(0, f"S-worker's own tier, {t.tier}, {gib(t.capacity_bytes)}")
    else:
        parts.append(f"no S-worker tier ({eng.tier.why_off})")
    speeds = ", ".join(f"{w.attend_gbps:.0f}" for w in workers if w.attend_gbps)
    print(f"fastdecode: KV tiers: {'; '.join(parts)} of {eng.kv_dtype} KV"
          + (f"; attention measured at {speeds} GB/s" if speeds else "") + f". {host_cap_note(eng)}",
          file=sys.stderr, flush=True)


def host_cap_note(eng) -> str:
    """What the host KV figure is: a ceiling the store fills page by page, and what set it (users
    read "19.4 GiB" on a shared machine as memory taken at start-up)."""
    kind = "The R-workers'" if eng.layout is not None else "The host store's"
    if eng.args.rworker_mem:
        cap = f"--rworker-mem, {gib(eng.args.rworker_mem)} a store"
    else:
        share = ", shared among the KV holders of a node" if eng.layout is not None else ""
        cap = f"the memory available at start-up less a reserve (10%, at least 1 GiB){share} (--rworker-mem sets it)"
    return f"{kind} figure is a cap, not an allocation: pages are taken as sequences grow, up to {cap}"


def place_by_tier_speeds(eng) -> int | None:
    """With the S-worker's own tier: every worker's attention speed measured now, for placement
    to send each sequence where its step ends earliest; -> the tier's worker index (None: no tier)."""
    if not isinstance(eng.backend, TieredBackend):
        return None
    t = eng.backend.tier_index
    probe = (512 << 20) if eng.device.type == "cuda" else (64 << 20)
    eng.placement.set_speeds(measured_speeds(eng.backend, eng.kv_bytes_per_token, probe))
    # a CPU S-worker's own store shares its cores with the S-part: until a decode step has timed
    # the S-part, it takes only what the R-workers have no room for
    eng.placement.overflow_only[t] = eng.tier.kind == "local"
    return t


def trip_prior(eng) -> tuple[float, float] | None:
    """The link's trip for the balance rule to start from (sched/balance.py; its decode steps then
    correct it): one echo of a small and of a large message to every R-worker at once, as (seconds
    fixed, seconds per R-row) there and back over every layer. None without a tier beside R-workers
    (the rule weighs nothing then)."""
    if eng.tier_index is None or eng.backend.num_workers < 2:
        return None
    c, act = eng.config, torch.finfo(eng.dtype).bits // 8
    out_row, back_row = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * act, c.num_heads * c.head_dim * act
    small, large = 64, 256 * out_row                       # a message's fixed cost; 256 rows' Q, K, V
    t_small, t_large = eng.backend.ping_all([small, large], repeats=5)
    per_byte = max((t_large - t_small) / (large - small), 0.0)
    fixed = max(t_small - per_byte * small, 0.0)
    return c.num_layers * 2 * fixed, c.num_layers * per_byte * (out_row + back_row)


def log_roster(eng) -> None:
    """One line per R-worker, so a launcher's report of a dead PID can be traced to its rank (its
    world rank and role: with data-parallel groups the backend's ranks are its group's)."""
    from fastdecode.launch.ranks import role_name, world_rank
    for w in eng.backend.workers:
        if w.tier:
            continue                     # the S-worker's own tier: _log_tiers names it
        kv = gib(w.capacity_bytes)
        rank = world_rank(w.rank)
        print(f"fastdecode: rank {rank} = {role_name(rank)} pid {w.pid} on {w.host}: {w.isa}, {w.threads} threads, "
              f"{kv} {eng.kv_dtype} KV ({eng.kv_bytes_per_token / 1024:.1f} KiB/token)"
              + (f"; kernel {w.kernel}" if w.kernel else "") + (f"; decode rows by {w.link}" if w.link else ""),
              file=sys.stderr, flush=True)


def tier_summary(eng) -> dict:
    """The run summary's KV tiers: sequences placed and peak KV bytes, the S-worker's own tier
    apart from the R-workers (one entry without a tier)."""
    workers, peaks, placed = eng.backend.workers, eng.recorder.kv_bytes_peak, eng.placement.placed
    groups = []
    for own in (True, False):
        idx = [i for i, w in enumerate(workers) if bool(w.tier) == own]
        if idx:
            groups.append({"tier": workers[idx[0]].tier if own else "R-workers" if eng.layout else "host store",
                           "sequences": sum(placed[i] for i in idx), "kv_bytes_peak": sum(peaks[i] for i in idx),
                           "kv_capacity_bytes": sum(workers[i].capacity_bytes for i in idx)})
    return {"kv_tiers": groups, "balance": {"gates_admission": eng.scheduler.balance is not None,
                                            **eng.balance.describe()}}


def learn_step(eng, stats) -> None:
    """A decode step's measurements to the balance (sched/balance.py), which learns from them the
    S-part's time by batch, each worker's speed and overhead, and the tier's cost to placement."""
    p, rows = eng.placement, eng.runner.last_rows          # rows: [B, (worker, position)]
    n = len(p.capacity_tokens)
    if p.windows:       # a windowed layer reads its window: per row
        tokens = [0.0] * n
        for w, pos in rows.tolist():
            tokens[w] += p.live_tokens(w, pos + 1)
    else:               # [W] KV tokens (all layers) each worker attended: positions + the new one
        tokens = np.bincount(rows[:, 0], weights=rows[:, 1] + 1, minlength=n).tolist()
    eng.balance.observe(len(rows), eng.runner.last_s_time, tokens, list(stats.attend_s), list(stats.busy_s),
                        eng.runner.last_r_wait)


def oom_advice(eng, e: BaseException) -> str:
    where = f"the GPU ({eng.device})" if eng.device.type == "cuda" else "the S-worker's host"
    tier = (f", its KV tier {gib(eng.backend.workers[eng.tier_index].capacity_bytes)}"
            if eng.tier_index is not None else "")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"{where} ran out of memory in step {eng.step_no} ({len(eng.scheduler.running)} sequences "
            f"running{tier}): {first[:200]}. Finished rows are in the output; rerun to resume with less "
            f"memory asked: --device-kv-memory, --gpu-memory-utilization, --max-batch or --max-prefill-tokens")
