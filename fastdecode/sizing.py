"""The sizing model (DESIGN.md §4, FastDecode §3 "model-guided orchestration").

Given a Profile (measured by `fastdecode profile`, or built from stated hardware), a batch B,
a generation length S, a prompt length and P R-workers, predict per-layer S/R/link times, the
step latency with or without the pipeline, tokens/s, which side bounds, and the R-workers needed.

Symbols (units): T(B) S-part time of one layer at batch B (s); N layers; R = seconds for one
R-worker to attend over one token of context in one layer (s/token) = KV bytes per token and
layer x seconds per KV byte; E(B) = B / T(B) (tokens/s per layer); C = KV tokens one R-worker
holds. Prompt length: with the stabilized schedule a running sequence's age is uniform over
[0, S), so its average KV length is prompt + S/2; every "½·S" of the paper becomes prompt + S/2:
    balance   P = B·(prompt + S/2)·R / T(B)      (= ½·S·R·E(B) when prompt = 0)
    capacity  B·(prompt + S/2) <= C·P            (the admission controller's W_lim adds B·F/2)
Prompts also cost the S-worker a prefill: in steady state B/S sequences start per step, so
B·prompt/S prompt tokens per step run the dense layers (at the best E, chunks being large) and
their K, V cross the link with the step's Q, K, V. A measured profile gives the prefill cost per
prompt token (prompt attention and staging included) by prompt length; from stated hardware the
attention over the prompt is left out (2·prompt·heads·head_dim FLOPs per token against
~12·hidden² for the dense part: 2% at Llama-7B, prompt 1024). The balance count above ignores prefill (it errs towards more R-workers).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from .admission import memory_batch

SCHEMA = "fastdecode-profile/1"
DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4,
               "fp8": 1, "int8": 1}


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

    def layer_flops_per_token(self) -> float:
        """S-part of one layer: QKV, O and the 3 SwiGLU matrices, 2 FLOPs per MAC."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return 2.0 * (qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate)

    def layer_weight_bytes(self) -> float:
        return self.layer_flops_per_token() / 2 * self.dtype_bytes

    def weight_bytes(self) -> float:
        return self.num_layers * self.layer_weight_bytes() + 2 * self.vocab * self.hidden * self.dtype_bytes

    def kv_bytes_per_token_layer(self, kv_dtype_bytes: int) -> int:
        return 2 * self.kv_heads * self.head_dim * kv_dtype_bytes

    def to_rworker_bytes_per_token(self) -> int:
        """Q, K, V of one token of one layer, S-worker -> R-worker."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim * self.dtype_bytes

    def from_rworker_bytes_per_token(self) -> int:
        return self.heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "config.json") -> "ModelDims":
        heads = cfg["num_attention_heads"]
        return cls(name=name, num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                   heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                   dtype_bytes=DTYPE_BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2))


MODEL_PRESETS = {   # published configs (HF config.json values)
    "llama-7b": ModelDims("llama-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-7b": ModelDims("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-13b": ModelDims("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    "llama-3-8b": ModelDims("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "smollm2-135m": ModelDims("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152),
}


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
    name: str
    seconds_per_kv_byte: float      # attention cost per KV byte read (s/B)
    call_overhead_s: float          # fixed cost per attention call (one layer, one mini-batch)
    capacity_bytes: float           # KV bytes it may hold
    threads: int = 0
    kernel_seconds_per_kv_byte: float = 0.0   # the attention kernel timed alone (reference; 0: not measured)
    page_tokens: int = 1            # KV pages of this many tokens per (sequence, layer): reservations round up

    def bandwidth(self) -> float:
        return 1.0 / self.seconds_per_kv_byte


@dataclass(slots=True)
class LinkProfile:
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

    def device_time(self, to_host_bytes: float, to_device_bytes: float) -> float:
        t = to_host_bytes / self.device_d2h_Bps if self.device_d2h_Bps > 0 else 0.0
        return t + (to_device_bytes / self.device_h2d_Bps if self.device_h2d_Bps > 0 else 0.0)

    def time(self, nbytes: float) -> float:
        """One-way time of a message: measured table where given (linear between points),
        latency + size / bandwidth elsewhere."""
        if nbytes <= 0:
            return 0.0
        if self.message_bytes and self.message_bytes[0] <= nbytes <= self.message_bytes[-1]:
            return float(np.interp(nbytes, self.message_bytes, self.message_time_s))
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(slots=True)
class Profile:
    model: ModelDims
    s_worker: SWorkerProfile
    r_workers: list[RWorkerProfile]
    link: LinkProfile
    kv_dtype_bytes: int = 2
    source: str = "measured"        # or "stated"
    notes: str = ""

    def workers(self, count: int) -> list[RWorkerProfile]:
        """`count` R-workers: the profiled ones, repeated in order when more are asked for."""
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
        if not d.get("r_workers"):
            raise ValueError("profile lists no r_workers")
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
        workers = [from_known_keys(RWorkerProfile, w) for w in d["r_workers"]]
        if any(w.seconds_per_kv_byte <= 0 or w.capacity_bytes < 0 for w in workers):
            raise ValueError("r_workers: seconds_per_kv_byte must be > 0 and capacity_bytes >= 0")
        link = from_known_keys(LinkProfile, d["link"])
        if link.bandwidth_Bps <= 0 or len(link.message_bytes) != len(link.message_time_s):
            raise ValueError("link: bandwidth must be > 0, message_bytes and message_time_s equal length")
        return cls(model=from_known_keys(ModelDims, d["model"]), s_worker=s, r_workers=workers, link=link,
                   kv_dtype_bytes=d.get("kv_dtype_bytes", 2), source=d.get("source", "measured"),
                   notes=d.get("notes", ""))

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))


def from_known_keys(cls, d: dict):
    """cls(**d) without the keys cls does not have (forward-compatible JSON)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------- stated hardware

@dataclass(slots=True)
class GpuSpec:
    """A GPU from its datasheet. S-part time of a layer = a soft max (p-norm, p=8) of the
    compute time at compute_eff of peak and the weight-streaming time at memory_eff of the
    bandwidth, never below a per-layer floor (kernel launches). compute_eff, p and the floor
    are fitted to the H100 anchors (DESIGN §5, max error 4% over B = 64..16384); memory_eff
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
    # datasheet: H100 SXM5 80GB, 989 dense bf16 TFLOP/s, 3.35 TB/s; measured grid from DESIGN §5
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
                   kv_dtype_bytes: int | None = None, mem_reserve: float = 0.10) -> Profile:
    """A Profile from stated hardware: one R-worker type per CPU socket with `cpu_bw_GBps` read
    bandwidth of which attention reaches `cpu_attn_eff` (0.66: torch SDPA bf16 on the H100 box,
    DESIGN §5), and `cpu_mem_GB` of memory less a reserve for the OS and buffers."""
    for what, v in (("cpu bandwidth", cpu_bw_GBps), ("cpu memory", cpu_mem_GB),
                    ("link bandwidth", link_bw_GBps), ("cpu efficiency", cpu_attn_eff)):
        if not v > 0:
            raise ValueError(f"{what} must be > 0 (got {v})")
    if link_latency_us < 0 or call_overhead_us < 0:
        raise ValueError("latencies must be >= 0")
    rw = RWorkerProfile(name=f"cpu-socket-{cpu_bw_GBps:g}GBps",
                        seconds_per_kv_byte=1.0 / (cpu_bw_GBps * 1e9 * cpu_attn_eff),
                        call_overhead_s=call_overhead_us * 1e-6,
                        capacity_bytes=cpu_mem_GB * 1e9 * (1 - mem_reserve), page_tokens=STORE_PAGE_TOKENS)
    link = LinkProfile(latency_s=link_latency_us * 1e-6, bandwidth_Bps=link_bw_GBps * 1e9)
    return Profile(model=model, s_worker=s_worker_from_spec(gpu, model), r_workers=[rw], link=link,
                   kv_dtype_bytes=kv_dtype_bytes or model.dtype_bytes, source="stated",
                   notes=f"gpu {gpu.name}: {gpu.peak_tflops:g} TFLOP/s, {gpu.mem_bw_GBps:g} GB/s; "
                         f"cpu {cpu_bw_GBps:g} GB/s x {cpu_attn_eff:g}, {cpu_mem_GB:g} GB; "
                         f"link {link_bw_GBps:g} GB/s, {link_latency_us:g} us")


# ---------------------------------------------------------------- predictions

STORE_PAGE_TOKENS = 32          # the AVX-512/AVX2 KV store's page (csrc/avx512/simd.h PT)
KV_RESERVE = ("full", "grow")   # generate's --kv-reserve (fastdecode/placement.py)


def held_tokens(worker: RWorkerProfile, gen_len: int, prompt_len: int, kv_reserve: str) -> float:
    """KV tokens one running sequence keeps from other sequences on `worker`, on average over its
    life, as fastdecode/placement.py reserves them:
    - full: its worst case, prompt + S rounded up to whole pages, from admission to the end;
    - grow: the pages it has filled plus the one its next token goes to (on average half a page
      past its length, +1/2 for that token), and one page of admission headroom per resident
      sequence (grow_overhead_tokens); at the stabilized schedule's steady state its length
      averages prompt + S/2."""
    if kv_reserve == "full":
        page = max(int(worker.page_tokens), 1)
        return math.ceil((prompt_len + gen_len) / page) * page
    if kv_reserve == "grow":
        return _avg_kv_len(gen_len, prompt_len) + grow_overhead_tokens(worker.page_tokens)
    raise ValueError(f"kv_reserve must be one of {KV_RESERVE}, got {kv_reserve!r}")


def grow_overhead_tokens(page_tokens: int) -> float:
    """What a growing sequence holds beyond its length: its last page half full, the next
    token's slot, a page of admission headroom (fastdecode/placement.py)."""
    return (3 * max(int(page_tokens), 1) + 1) / 2


def sequences_on_worker(capacity_tokens: float, worker: RWorkerProfile, gen_len: int, prompt_len: int,
                        kv_reserve: str) -> int:
    """How many sequences `capacity_tokens` of one worker hold at once. full: whole worst cases
    (placement's hard bound). grow: the count the stabilized schedule admits
    (fastdecode/admission.py memory_batch), which keeps the workload's peak, B*(prompt +
    (S+F)/2) plus the page overhead, within capacity: what it runs unless growth preempts."""
    if kv_reserve == "full":
        return int(capacity_tokens // held_tokens(worker, gen_len, prompt_len, kv_reserve))
    if kv_reserve == "grow":
        return memory_batch(capacity_tokens, gen_len, gen_len, prompt_len,
                            grow_overhead_tokens(worker.page_tokens))[0]
    raise ValueError(f"kv_reserve must be one of {KV_RESERVE}, got {kv_reserve!r}")


def sequences_fitting(profile: Profile, workers: list[RWorkerProfile], gen_len: int, prompt_len: int,
                      kv_reserve: str) -> int:
    """How many sequences the workers' memory holds at once (sequences_on_worker, summed)."""
    per_token = profile.model.num_layers * profile.model.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    return sum(sequences_on_worker(w.capacity_bytes // per_token, w, gen_len, prompt_len, kv_reserve)
               for w in workers)


@dataclass(slots=True)
class Prediction:
    batch: int                      # asked for
    batch_run: int                  # what fits in the R-workers' memory (<= batch)
    gen_len: int                    # S
    prompt_len: int
    rworkers: int
    rworkers_needed: int | None     # None: no P balances (R-worker call overhead >= S-part time)
    pipeline_depth: int
    kv_reserve: str                 # "full" | "grow": how a sequence reserves KV (generate's --kv-reserve)
    kv_tokens_needed: float         # batch * what a sequence holds (held_tokens): full ~ prompt + S, grow ~ prompt + S/2
    kv_tokens_capacity: float       # of these rworkers
    s_layer_s: float                # per layer, summed over the mini-batches
    r_layer_s: float
    link_layer_s: float
    layer_s: float                  # per layer with the pipeline
    prefill_s: float                # S-worker prefill per step, amortized (s)
    step_latency_s: float           # one token for every running sequence
    tokens_per_s: float
    bound: str                      # "S" | "R" | "link" | "capacity"
    efficiency: float               # E(batch_run / depth) / best E on the grid: S-part utilization

    def to_dict(self) -> dict:
        d = asdict(self)
        d["latency_per_token_s"] = self.step_latency_s
        return d


def _avg_kv_len(gen_len: int, prompt_len: int) -> float:
    return prompt_len + gen_len / 2


def _r_time(profile: Profile, workers: list[RWorkerProfile], kv_tokens: float) -> float:
    """One attention call per worker for `kv_tokens` of context in one layer; placement gives
    each worker a share proportional to its bandwidth, so all finish together but for overhead."""
    kv_bytes = kv_tokens * profile.model.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    total_bw = sum(w.bandwidth() for w in workers)
    return max(w.call_overhead_s for w in workers) + kv_bytes / total_bw


def _prefill_tokens(batch: float, gen_len: int, prompt_len: int) -> float:
    """Prompt tokens prefilled per step in steady state: batch/gen_len sequences start per step."""
    return batch * prompt_len / gen_len


def layer_times(profile: Profile, batch: int, gen_len: int, prompt_len: int, rworkers: int,
                depth: int) -> dict:
    """Per layer, with `depth` mini-batches of batch/depth in flight. Per mini-batch: s (S-part),
    r (R-part), link (Q,K,V out + O back). Each resource serves every mini-batch once per layer
    (its load, depth * x), and one mini-batch's chain s -> link -> r -> link must also fit in the
    cycle: layer = max(depth*s, depth*r, depth*link, s + r + link + hop). Depth 1 gives s + r +
    link + hop; depth 2 with balanced sides gives max(S, R, link) of the whole batch, unless the
    chain cannot hide behind the other mini-batch (a slow link, or small mini-batches whose work
    is shorter than the chain's hand-offs, `hop`). The step's prompt K, V travel with the Q, K, V;
    on a GPU S-worker the link includes the device<->host copies (PCIe) on both ends of the chain."""
    m = profile.model
    mini = batch / depth
    s = profile.s_worker.layer_time(mini)
    r = _r_time(profile, profile.workers(rworkers), mini * _avg_kv_len(gen_len, prompt_len))
    prompt_kv = _prefill_tokens(mini, gen_len, prompt_len) * m.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    out_bytes, back_bytes = mini * m.to_rworker_bytes_per_token() + prompt_kv, mini * m.from_rworker_bytes_per_token()
    link = (profile.link.time(out_bytes) + profile.link.time(back_bytes)
            + profile.link.device_time(out_bytes, back_bytes))
    parts = {"S": s, "R": r, "link": link}
    chain = s + r + link + profile.link.hop_s
    layer = max(depth * max(parts.values()), chain)
    return {"s": depth * s, "r": depth * r, "link": depth * link, "layer": layer,
            "bound": max(parts, key=parts.get)}


def kv_tokens_capacity(profile: Profile, rworkers: int) -> float:
    per_token = profile.model.num_layers * profile.model.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    return sum(w.capacity_bytes for w in profile.workers(rworkers)) / per_token


def rworkers_needed(profile: Profile, batch: int, gen_len: int, prompt_len: int = 0,
                    depth: int = 2, max_workers: int = 1 << 14, kv_reserve: str = "full") -> int | None:
    """Fewest R-workers whose R-part per mini-batch is no slower than the S-part (balance) and
    whose memory holds the batch as `kv_reserve` reserves it (capacity). None if no count up to
    max_workers does (e.g. the R-worker call overhead alone exceeds the S-part)."""
    mini = batch / depth
    t_s = profile.s_worker.layer_time(mini)
    kv_bytes = mini * _avg_kv_len(gen_len, prompt_len) * profile.model.kv_bytes_per_token_layer(
        profile.kv_dtype_bytes)
    # [P] totals over the first P workers (the profiled list repeated): q full rounds + a prefix
    ws = profile.r_workers
    q, r = np.divmod(np.arange(1, max_workers + 1), len(ws))

    def total(values):
        prefix = np.concatenate([[0.0], np.cumsum(values)])
        return q * prefix[-1] + prefix[r]

    bw = total([w.bandwidth() for w in ws])
    held = total([sequences_fitting(profile, [w], gen_len, prompt_len, kv_reserve) for w in ws])
    first_max = np.maximum.accumulate([w.call_overhead_s for w in ws])
    overhead = first_max[np.minimum(np.arange(max_workers), len(ws) - 1)]
    ok = (overhead + kv_bytes / bw <= t_s * (1 + 1e-9)) & (held >= batch)
    return int(np.argmax(ok)) + 1 if ok.any() else None


ADMIT_FRACTION = 16     # the stabilized schedule's default micro-batch: B/16 sequences every S/16 steps


def predict(profile: Profile, batch: int, gen_len: int, prompt_len: int = 0,
            rworkers: int | None = None, depth: int = 2, prefill_chunk: int | None = None,
            kv_reserve: str = "full") -> Prediction:
    """Steady-state prediction with the stabilized schedule. If the batch does not fit in the
    R-workers' memory as `kv_reserve` reserves it (generate's --kv-reserve: full, the default,
    holds every sequence's worst case; grow what it has filled), the batch that fits runs
    instead and bound = "capacity". Prompts are prefilled in chunks of
    `prefill_chunk` tokens; by default one admitted micro-batch's prompts (B/16 of them) up to
    the largest chunk the profile measured (the engine's --max-prefill-tokens)."""
    if batch < 1 or gen_len < 1 or prompt_len < 0 or depth < 1:
        raise ValueError("need batch >= 1, gen_len >= 1, prompt_len >= 0, depth >= 1")
    needed = rworkers_needed(profile, batch, gen_len, prompt_len, depth, kv_reserve=kv_reserve)
    if rworkers is None:
        rworkers = needed if needed is not None else len(profile.r_workers)
    if rworkers < 1:
        raise ValueError("need at least one R-worker")
    workers = profile.workers(rworkers)
    cap = kv_tokens_capacity(profile, rworkers)
    need = batch * sum(held_tokens(w, gen_len, prompt_len, kv_reserve) for w in workers) / len(workers)
    batch_run = min(batch, sequences_fitting(profile, workers, gen_len, prompt_len, kv_reserve))
    common = dict(batch=batch, gen_len=gen_len, prompt_len=prompt_len, rworkers=rworkers,
                  rworkers_needed=needed, pipeline_depth=depth, kv_reserve=kv_reserve,
                  kv_tokens_needed=need, kv_tokens_capacity=cap)
    if batch_run < 1:
        return Prediction(**common, batch_run=0, s_layer_s=0.0, r_layer_s=0.0, link_layer_s=0.0,
                          layer_s=math.inf, prefill_s=0.0, step_latency_s=math.inf, tokens_per_s=0.0,
                          bound="capacity", efficiency=0.0)
    t = layer_times(profile, batch_run, gen_len, prompt_len, rworkers, depth)
    n = profile.model.num_layers
    sw = profile.s_worker
    grid_best = max(b / x for b, x in zip(sw.batch_grid, sw.layer_time_s))
    if prefill_chunk is None and sw.prefill_chunk_grid:
        prefill_chunk = min(max(prompt_len, batch_run * prompt_len / ADMIT_FRACTION), max(sw.prefill_chunk_grid))
    per_token = sw.prefill_time_per_token(prompt_len, prefill_chunk)
    if per_token is None:      # stated hardware: dense layers at the best efficiency, attention left out
        per_token = n / grid_best
    prefill = _prefill_tokens(batch_run, gen_len, prompt_len) * per_token
    step = n * t["layer"] + sw.head_time(batch_run) + prefill
    return Prediction(**common, batch_run=batch_run, s_layer_s=t["s"], r_layer_s=t["r"],
                      link_layer_s=t["link"], layer_s=t["layer"], prefill_s=prefill,
                      step_latency_s=step, tokens_per_s=batch_run / step,
                      bound="capacity" if batch_run < batch else t["bound"],
                      efficiency=sw.efficiency(batch_run / depth) / grid_best)
