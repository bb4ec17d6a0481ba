"""The S-worker's own KV tier: whether a job has one, what holds it, and how large it is.

- GPU S-worker: pages in the card's memory (rpart/device_kv.py), by default what is free once the
  weights are in, less the activations' reserve, under `--gpu-memory-utilization` of the card
  (vLLM's habit); in local mode (`-n 1`) the host's own store sits beside it for what the card
  cannot hold.
- CPU S-worker beside R-workers: off unless asked for (--device-kv or --device-kv-memory): its
  attention runs in turn with the dense layers on the same cores and memory bus, so it gains only
  where the S-part is small beside the KV (docs/results.md measures it). Asked for, it is the
  in-process AVX-512 store (rpart/local.py), by default an equal share of its node's memory with the
  R-workers there. In local mode (`-n 1`) that store already is the whole R-part.
Placement (sched/placement.py) then sends each sequence where the step ends earliest, from the
tiers' measured speeds: a tier that does not pay on a machine holds nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fastdecode.model.config import ConfigError, ModelConfig
from fastdecode.rpart.base import RBackend
from rworker.host.capacity import default_capacity_bytes
from rworker.protocol.kvformat import PAGE_TOKENS

TIER_KV_DTYPES = ("fp32", "bf16", "fp16")       # the device tier's pages; int8 stays on the R-workers
TORCH_TIER_ENV = "FASTDECODE_DEVICE_TIER"       # "torch": the GPU's tier (torch pages) on any device, for tests
CPU_TORCH_TIER_BYTES = 1 << 30
SPEED_PROBE_SEQS = 16


@dataclass(slots=True)
class TierChoice:
    kind: str                      # "": none; "device": pages on the S-worker's GPU; "local": the in-process store
    capacity_bytes: int | None     # None: from the device's free memory once the weights are in
    why_off: str = ""              # why there is none (said on the start-up line)


def gib(n: float) -> str:
    """A memory size for people: GiB from 1 GiB on, else MiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def choose_tier(enabled: bool | None, asked: int | None, device: torch.device, kv_dtype: str, world: int,
                ranks_here: int, kv_token_bytes: int = 0) -> TierChoice:
    """The tier of a job: `enabled` False is --no-device-kv, True --device-kv, None auto; `asked`
    --device-kv-memory (None: auto); `ranks_here` the ranks on the S-worker's node (itself
    included); `kv_token_bytes` a token's KV over all layers (a page of PAGE_TOKENS of them, the
    least a tier can hold).
    Raises ConfigError where an asked size cannot be met (checked again against free memory once
    the weights are in): less than a page, more than the device or machine has, or on a CPU S-worker
    so much that the R-workers beside it would be left nothing."""
    if enabled is False:
        return TierChoice("", 0, "--no-device-kv")
    page_bytes = PAGE_TOKENS * kv_token_bytes
    if asked is not None and asked < page_bytes:
        raise ConfigError(f"--device-kv-memory {asked:,} bytes is less than one KV page of this model "
                          f"({gib(page_bytes)}): a size is in bytes unless it has a unit (K, M, G, T: 40G)")
    if device.type == "cuda" or os.environ.get(TORCH_TIER_ENV, "").strip() == "torch":
        if kv_dtype not in TIER_KV_DTYPES:
            return TierChoice("", 0, f"{kv_dtype} KV lives on the R-workers only")
        if device.type != "cuda":         # the GPU's code on a CPU, for tests: a small tier unless asked
            return TierChoice("device", asked if asked is not None else
                              min(CPU_TORCH_TIER_BYTES, default_capacity_bytes(share=max(ranks_here, 1))))
        free, _ = torch.cuda.mem_get_info(device)
        if asked is not None and asked > free:
            raise ConfigError(f"--device-kv-memory {gib(asked)} is more than the {gib(free)} free on {device} "
                              f"(before the weights load): ask for less, or --no-device-kv")
        return TierChoice("device", asked)
    if asked is not None:
        _check_host_tier(asked, ranks_here - 1 if world > 1 else 0)
    if world <= 1:
        unused = " (--device-kv-memory sizes nothing here: --rworker-mem sizes the store)" if asked else ""
        return TierChoice("", 0, "local mode: the in-process store is the whole R-part" + unused)
    if enabled is None and asked is None:
        return TierChoice("", 0, "a CPU S-worker's attention would run in turn with its dense layers; "
                                 "--device-kv turns it on")
    return TierChoice("local", asked if asked is not None else default_capacity_bytes(share=max(ranks_here, 1)))


def _check_host_tier(asked: int, rworkers_here: int) -> None:
    """A CPU S-worker's tier fits this machine, and leaves the R-workers on its node some memory
    (each takes what is available less a reserve and the tier: none left would end them at start-up)."""
    import psutil
    total = psutil.virtual_memory().total
    if asked > total:
        raise ConfigError(f"--device-kv-memory {gib(asked)} is more than this machine's memory ({gib(total)})")
    room = default_capacity_bytes()
    if rworkers_here > 0 and asked >= room:
        raise ConfigError(f"--device-kv-memory {gib(asked)} leaves nothing for the {rworkers_here} R-worker(s) on "
                          f"this node: {gib(room)} is available after the reserve; ask for less")


def activation_reserve_bytes(config: ModelConfig, dtype: torch.dtype, max_prefill_tokens: int,
                             max_batch: int) -> int:
    """Device memory the S-part's activations may need at once: a prefill chunk's (about
    hidden*6 + intermediate*3 values a token, as resolve_batch_limits counts them), and a decode
    step's rows with their fp32 logits twice (sampling's copies)."""
    per_token = (6 * config.hidden_size + 3 * config.intermediate_size) * torch.finfo(dtype).bits // 8
    return max_prefill_tokens * per_token + max_batch * (per_token + 8 * config.vocab_size)


def device_tier_bytes(asked: int | None, utilization: float, device: torch.device, reserve: int) -> int:
    """The device tier's size once the weights are in: `asked`, or what is free under
    utilization x the card's memory, less the activations' reserve."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if device.type != "cuda":                 # the torch tier on a CPU (FASTDECODE_DEVICE_TIER=torch)
        return asked
    free, total = torch.cuda.mem_get_info(device)
    room = max(min(free - reserve, free - int(total * (1 - utilization))), 0)
    if asked is None:
        return room
    if asked > room:
        raise ConfigError(f"--device-kv-memory {gib(asked)} does not fit on {device}: {gib(free)} free with the "
                          f"weights in, {gib(reserve)} of it kept for activations: at most {gib(room)}")
    return asked


def measured_speeds(backend: RBackend, kv_bytes_per_token: int, probe_bytes: int) -> list[float]:
    """Each worker's attention speed in KV tokens (all layers) per second, timed now on its own
    kernel and memory (rpart's profile_workers: a short and a long context per worker)."""
    results = backend.profile_workers(SPEED_PROBE_SEQS, probe_bytes)
    speeds = [r["bandwidth_GBps"] * 1e9 / kv_bytes_per_token for r in results]
    for w, r in zip(backend.workers, results):
        w.attend_gbps = float(r["bandwidth_GBps"])
        w.attend_call_s = float(r.get("call_overhead_s", 0.0))
    return speeds
