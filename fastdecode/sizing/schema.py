"""The `fastdecode-profile/1` schema: the model's shape and what each part of the machine costs.

`fastdecode profile` measures these, `sizing.hardware` builds them from stated hardware, and
`sizing.model` predicts from them. JSON round-trips through to_json/from_json; keys a part does
not know are ignored (forward compatible), and a part a profile lacks takes its default: a profile
without `device_tier` (older, or measured with --no-device-kv) plans all KV on the R-workers.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from fastdecode.model.presets import PRESETS
from rworker.protocol.kvformat import DTYPE_BYTES

SCHEMA = "fastdecode-profile/1"


# ---------------------------------------------------------------- model shape

@dataclass(slots=True)
class ModelDims:
    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2            # weights and activations
    windows: tuple = ()             # [layers] sliding window per layer (0: full); (): all full
    experts_stored: float = 0.0     # MoE: the MLP widths held, in units of `intermediate` (0: dense)
                                    # (active per token: `intermediate` itself, top-k experts + shared)

    def __post_init__(self):
        self.windows = tuple(int(w) for w in self.windows) if any(self.windows) else ()   # JSON gives a list

    def layer_flops_per_token(self) -> float:
        """S-part of one layer: QKV, O and the 3 SwiGLU matrices (MoE: the active experts'), 2 FLOPs per MAC."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return 2.0 * (qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate)

    def layer_weight_bytes(self) -> float:
        if not self.experts_stored:
            return self.layer_flops_per_token() / 2 * self.dtype_bytes
        attn = self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        return (attn + 3 * self.hidden * self.intermediate * self.experts_stored) * self.dtype_bytes

    def read_fraction(self, tokens: float) -> float:
        """Of a `tokens`-long context, the share the R-part reads per layer on average: a windowed
        layer reads its window only."""
        if not self.windows or tokens <= 0:
            return 1.0
        return sum(min(tokens, w) if w else tokens for w in self.windows) / (len(self.windows) * tokens)

    def held_fraction(self, tokens: float, page: int = 32) -> float:
        """Of a `tokens`-long context's pages, the share a store keeps: a windowed layer its
        window's pages and one more (what placement charges)."""
        if not self.windows or tokens <= 0:
            return 1.0
        pages = math.ceil(tokens / page)
        keep = [min(pages, math.ceil(w / page) + 1) if w else pages for w in self.windows]
        return sum(keep) / (len(keep) * pages)

    def weight_bytes(self) -> float:
        return self.num_layers * self.layer_weight_bytes() + 2 * self.vocab * self.hidden * self.dtype_bytes

    def kv_bytes_per_token_layer(self, kv_dtype_bytes: float) -> int:
        """K and V bytes of one token at one layer; kv_dtype_bytes per element, scales included
        (int8: 1 + 4 / head_dim, rworker.protocol.kvformat.kv_elem_bytes)."""
        return round(2 * self.kv_heads * self.head_dim * kv_dtype_bytes)

    def to_rworker_bytes_per_token(self) -> int:
        """Q, K, V of one token of one layer, S-worker -> R-worker."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim * self.dtype_bytes

    def from_rworker_bytes_per_token(self) -> int:
        return self.heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "config.json") -> "ModelDims":
        cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        width, stored = cfg["intermediate_size"], 0.0
        if experts:        # active per token: top-k experts and a shared one; held: every expert
            moe = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            shared = cfg.get("shared_expert_intermediate_size") or 0
            width = cfg.get("num_experts_per_tok", 2) * moe + shared
            stored = (experts * moe + shared) / width
        return cls(name=name, num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                   heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=width, vocab=cfg["vocab_size"],
                   dtype_bytes=DTYPE_BYTES.get(str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))), 2),
                   windows=_layer_windows(cfg, name), experts_stored=stored)


def _layer_windows(cfg: dict, name: str) -> tuple:
    """The per-layer sliding windows fastdecode would serve the config with (() if none, or if
    it does not serve the architecture: `plan` sizes any shape)."""
    from fastdecode.model.config import ConfigError, config_from_hf_dict
    try:
        windows = tuple(getattr(config_from_hf_dict(cfg, name), "layer_windows", ()) or ())
    except ConfigError:
        return ()
    return windows if any(windows) else ()



MODEL_PRESETS = {name: ModelDims.from_hf_config(cfg, name) for name, cfg in PRESETS.items()}


# ---------------------------------------------------------------- profile schema

@dataclass(slots=True)
class SWorkerProfile:
    device: str
    batch_grid: list[int]           # batch sizes measured, ascending
    layer_time_s: list[float]       # S-part of one layer at each batch (s)
    head_time_s: list[float]        # LM head + sampling, once per step, at each batch (s)
    mem_bytes: float = 0.0          # device memory, 0 = unknown
    prefill_prompt_len: list[int] = field(default_factory=list)   # prompt lengths measured, ascending
    prefill_token_s: list[float] = field(default_factory=list)    # whole-model prefill, s per prompt token
    prefill_chunk: int = 0          # tokens per prefill chunk of the prompt-length table (0: unknown)
    prefill_chunk_grid: list[int] = field(default_factory=list)   # chunk sizes measured, ascending ...
    prefill_chunk_token_s: list[float] = field(default_factory=list)  # ... s per token at prefill_chunk_prompt_len
    prefill_chunk_prompt_len: int = 0
    quantization: str = ""          # "fp8": measured with fp8 weights (--quantization fp8); "": the dtype's

    def _interp(self, values: list[float], batch: float) -> float:
        """log-log between grid points; below the grid flat (weights are read anyway), above
        linear in B (compute-bound)."""
        grid = np.asarray(self.batch_grid, dtype=np.float64)
        t = np.asarray(values, dtype=np.float64)
        if batch <= grid[0]:
            return float(t[0])
        if batch >= grid[-1]:
            return float(t[-1] * batch / grid[-1])
        if (t <= 0).any():      # e.g. a head time not measured (0): no logs
            return float(np.interp(batch, grid, t))
        return float(np.exp(np.interp(np.log(batch), np.log(grid), np.log(t))))

    def layer_time(self, batch: float) -> float:
        return self._interp(self.layer_time_s, batch)

    def head_time(self, batch: float) -> float:
        return self._interp(self.head_time_s, batch)

    def prefill_time_per_token(self, prompt_len: float, chunk: float | None = None) -> float | None:
        """Measured prefill cost per prompt token (all layers, prompt attention included),
        linear in the prompt length between grid points, flat outside; None when not measured.

        The table holds chunks of `prefill_chunk` tokens. A prompt token costs attention over its
        prompt (grows with prompt_len) plus dense layers over the chunk's rows (depends on the
        chunk: on a GPU small chunks waste the GEMMs, on a CPU big ones spill the caches). With a
        chunk-size table (measured at a short prompt, where the dense part dominates) a `chunk`
        other than the table's adds the dense part's difference: t(p, c) = t(p, c0) + u(c) - u(c0),
        u linear in log(chunk) between grid points, flat outside."""
        if not self.prefill_prompt_len:
            return None
        t = float(np.interp(prompt_len, self.prefill_prompt_len, self.prefill_token_s))
        if chunk is None or not self.prefill_chunk_grid or self.prefill_chunk <= 0:
            return t
        grid, cost = np.log(self.prefill_chunk_grid), self.prefill_chunk_token_s
        shift = np.interp(np.log(max(chunk, 1.0)), grid, cost) - np.interp(np.log(self.prefill_chunk), grid, cost)
        return max(t + float(shift), 0.05 * t)

    def efficiency(self, batch: float) -> float:
        """E(B) = B / T(B): tokens per second through one layer."""
        return batch / self.layer_time(batch)

    def knee(self, frac: float = 0.9) -> int:
        """Smallest batch whose E(B) reaches `frac` of the best E over the grid."""
        bs = np.unique(np.geomspace(self.batch_grid[0], self.batch_grid[-1], 400).round()).astype(int)
        e = np.array([self.efficiency(b) for b in bs])
        return int(bs[np.argmax(e >= frac * e.max())])


@dataclass(slots=True)
class RWorkerProfile:
    """One R-worker's attention cost and memory. shared_cost_ratio 1.0 means not measured (an
    old profile, stated hardware without --shared-cost-ratio): a member-token of shared prefix
    is priced as a streamed token, the conservative case."""
    name: str
    seconds_per_kv_byte: float      # attention cost per KV byte read (s/B)
    call_overhead_s: float          # fixed cost per attention call (one layer, one mini-batch)
    capacity_bytes: float           # KV bytes it may hold
    threads: int = 0
    kernel_seconds_per_kv_byte: float = 0.0   # the attention kernel timed alone (reference; 0: not measured)
    page_tokens: int = 1            # KV pages of this many tokens per (sequence, layer): reservations round up
    # a member-token of shared prefix against a streamed KV token: the kernel reads shared pages
    # once per group but runs every member's heads over them (rworker.bench.measure_shared_attention)
    shared_cost_ratio: float = 1.0
    # the same as seconds per member-byte of shared prefix (0: not measured); where measured the model
    # takes the ratio to the in-step seconds_per_kv_byte from it (compute-bound: steadier than the ratio)
    shared_seconds_per_kv_byte: float = 0.0

    def bandwidth(self) -> float:
        return 1.0 / self.seconds_per_kv_byte


@dataclass(slots=True)
class TierProfile:
    """The S-worker's own KV tier (docs/design.md, "The S-worker's own KV tier"): sequences whose
    KV it holds and attends to itself, its attention on the S-part's critical path. Measured by
    `fastdecode profile` where the job has one, or stated (`plan --device-kv-memory/--device-kv-gbps`)."""
    name: str                       # "device (cuda:0)", "local (in-process store)", or a stated one
    seconds_per_kv_byte: float      # attention cost per KV byte read, as the step pays it (s/B)
    call_overhead_s: float          # fixed cost per attention call (one layer, one mini-batch)
    capacity_bytes: float           # KV bytes it holds
    kind: str = "device"            # "device": the S-worker's GPU memory; "local": a CPU S-worker's own store
    page_tokens: int = 32           # KV pages of this many tokens (placement rounds up to whole pages)
    frees_windows: bool = False     # a sliding-window layer's pages leave once outside the window
                                    # (the device tier keeps them: charged in full)
    kernel_seconds_per_kv_byte: float = 0.0   # the kernel timed alone (what the engine's placement
                                              # measures at start-up; 0: not measured)

    def bandwidth(self) -> float:
        return 1.0 / self.seconds_per_kv_byte


TIER_KINDS = ("device", "local")


@dataclass(slots=True)
class LinkProfile:
    """The S<->R link. The headline figures and table are the slowest R-worker's (the one whose
    messages bound a step); a measured profile keeps every R-worker's own table beside them, and
    what the S-worker's path carries to all R-workers at once."""
    latency_s: float
    bandwidth_Bps: float
    message_bytes: list[int] = field(default_factory=list)    # measured sizes, ascending
    message_time_s: list[float] = field(default_factory=list)  # one-way time for each
    # a GPU S-worker's own hop between device and host memory (PCIe), bytes/s each way; 0 = none
    device_d2h_Bps: float = 0.0
    device_h2d_Bps: float = 0.0
    # per layer, what one mini-batch's chain S -> link -> R -> link takes beyond its parts:
    # waiting ranks waking up, progress threads polling, the device event -> MPI hand-off
    hop_s: float = 0.0
    # each R-worker alone, in the profile's worker order: its name and one-way time per message
    # size ([workers, sizes], sizes as message_bytes) with its own latency and bandwidth fit
    worker_names: list[str] = field(default_factory=list)
    worker_message_time_s: list[list[float]] = field(default_factory=list)
    worker_latency_s: list[float] = field(default_factory=list)
    worker_bandwidth_Bps: list[float] = field(default_factory=list)
    # bytes/s the S-worker moves to all the profiled R-workers at once (their messages in flight
    # together); 0 = not measured: the R-workers' messages share one path (stated hardware, one NIC)
    concurrent_Bps: float = 0.0

    def device_time(self, to_host_bytes: float, to_device_bytes: float) -> float:
        t = to_host_bytes / self.device_d2h_Bps if self.device_d2h_Bps > 0 else 0.0
        return t + (to_device_bytes / self.device_h2d_Bps if self.device_h2d_Bps > 0 else 0.0)

    def time(self, nbytes: float) -> float:
        """One-way time of a message on the slowest R-worker's link."""
        return message_time(nbytes, self.message_bytes, self.message_time_s, self.latency_s, self.bandwidth_Bps)

    def per_worker(self) -> bool:
        return len(self.worker_message_time_s) > 0

    def worker_time(self, worker: int, nbytes: float) -> float:
        """One-way time of a message to R-worker `worker` (its own table; the profiled workers
        repeat in order past their count, as Profile.workers does)."""
        if not self.per_worker():
            return self.time(nbytes)
        w = worker % len(self.worker_message_time_s)
        return message_time(nbytes, self.message_bytes, self.worker_message_time_s[w],
                            self.worker_latency_s[w], self.worker_bandwidth_Bps[w])

    def slowest_worker(self) -> int:
        """The R-worker whose largest message takes longest (0 without per-worker tables)."""
        if not self.per_worker():
            return 0
        return int(np.argmax([t[-1] for t in self.worker_message_time_s]))

    def worker_name(self, worker: int) -> str:
        return self.worker_names[worker % len(self.worker_names)] if self.worker_names else "the link"


def message_time(nbytes: float, sizes: list[int], times: list[float], latency_s: float, bandwidth_Bps: float) -> float:
    """One-way time of an `nbytes` message: the measured table where it covers the size (linear
    between points); past its largest size that point's time plus the rest at the bandwidth
    (a big message over TCP is bandwidth, its latency already in the point); latency + size /
    bandwidth without a table or below it."""
    if nbytes <= 0:
        return 0.0
    if sizes and sizes[0] <= nbytes <= sizes[-1]:
        return float(np.interp(nbytes, sizes, times))
    if sizes and nbytes > sizes[-1]:
        return times[-1] + (nbytes - sizes[-1]) / bandwidth_Bps
    return latency_s + nbytes / bandwidth_Bps


@dataclass(slots=True)
class Profile:
    model: ModelDims
    s_worker: SWorkerProfile
    r_workers: list[RWorkerProfile]
    link: LinkProfile
    kv_dtype_bytes: float = 2       # per K or V element, scales included (int8: 1 + 4/head_dim)
    source: str = "measured"        # or "stated"
    notes: str = ""
    device_tier: TierProfile | None = None     # the S-worker's own KV tier (None: all KV on the R-workers)
    cores_shared: str = ""          # why a job where it was measured runs slower than its parts timed alone
                                    # (its ranks share cores: profile.shared_cores_note); "" where they do not

    def workers(self, count: int) -> list[RWorkerProfile]:
        """`count` R-workers: the profiled ones, repeated in order when more are asked for."""
        if count and not self.r_workers:
            raise ValueError(f"the profile has no R-worker to plan {count} of (its KV is the S-worker's tier "
                             f"alone): state one with --cpu-bw")
        return [self.r_workers[i % len(self.r_workers)] for i in range(count)]

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        """Keys a part does not know (measurement metadata, raw samples) are ignored."""
        if d.get("schema", SCHEMA) != SCHEMA:
            raise ValueError(f"profile schema {d.get('schema')!r} is not {SCHEMA!r}")
        tier = from_known_keys(TierProfile, d["device_tier"]) if d.get("device_tier") else None
        if not d.get("r_workers") and tier is None:
            raise ValueError("profile lists no r_workers and no device_tier")
        s = from_known_keys(SWorkerProfile, d["s_worker"])
        if len(s.batch_grid) < 1 or not (len(s.batch_grid) == len(s.layer_time_s) == len(s.head_time_s)):
            raise ValueError("s_worker: batch_grid, layer_time_s and head_time_s must have equal, nonzero length")
        if list(s.batch_grid) != sorted(s.batch_grid) or min(s.layer_time_s) <= 0:
            raise ValueError("s_worker: batch_grid must ascend and layer times be positive")
        if len(s.prefill_prompt_len) != len(s.prefill_token_s) or \
                list(s.prefill_prompt_len) != sorted(s.prefill_prompt_len):
            raise ValueError("s_worker: prefill_prompt_len must ascend and match prefill_token_s in length")
        if len(s.prefill_chunk_grid) != len(s.prefill_chunk_token_s) or \
                list(s.prefill_chunk_grid) != sorted(s.prefill_chunk_grid) or min(s.prefill_chunk_grid, default=1) < 1:
            raise ValueError("s_worker: prefill_chunk_grid must ascend from >= 1 and match prefill_chunk_token_s in length")
        workers = [from_known_keys(RWorkerProfile, w) for w in d.get("r_workers") or []]
        if any(w.seconds_per_kv_byte <= 0 or w.capacity_bytes < 0 for w in workers):
            raise ValueError("r_workers: seconds_per_kv_byte must be > 0 and capacity_bytes >= 0")
        if any(not 0 < w.shared_cost_ratio <= 1 for w in workers):
            raise ValueError("r_workers: shared_cost_ratio must be in (0, 1]")
        link = from_known_keys(LinkProfile, d["link"])
        if link.bandwidth_Bps <= 0 or len(link.message_bytes) != len(link.message_time_s):
            raise ValueError("link: bandwidth must be > 0, message_bytes and message_time_s equal length")
        per = (link.worker_names, link.worker_latency_s, link.worker_bandwidth_Bps)
        if link.worker_message_time_s and (any(len(x) != len(link.worker_message_time_s) for x in per)
                                           or any(len(t) != len(link.message_bytes) for t in link.worker_message_time_s)
                                           or min(link.worker_bandwidth_Bps) <= 0):
            raise ValueError("link: every R-worker needs a name, a latency, a bandwidth > 0 and a time per "
                             "message size")
        if tier is not None and (tier.seconds_per_kv_byte <= 0 or tier.capacity_bytes < 0 or tier.call_overhead_s < 0
                                 or tier.kind not in TIER_KINDS or tier.page_tokens < 1):
            raise ValueError(f"device_tier: seconds_per_kv_byte must be > 0, capacity_bytes and call_overhead_s "
                             f">= 0, page_tokens >= 1 and kind one of {', '.join(TIER_KINDS)}")
        return cls(model=from_known_keys(ModelDims, d["model"]), s_worker=s, r_workers=workers, link=link,
                   kv_dtype_bytes=d.get("kv_dtype_bytes", 2), source=d.get("source", "measured"),
                   notes=d.get("notes", ""), device_tier=tier, cores_shared=str(d.get("cores_shared", "")))

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))


def from_known_keys(cls, d: dict):
    """cls(**d) without the keys cls does not have (forward-compatible JSON)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})

