"""The timings behind `fastdecode profile`, each on the job's own engine and machines: the
S-part per layer (CPU: busy time in the decode step; GPU: device time), prefill per prompt token,
each R-worker's (and the S-worker's own KV tier's) cost per KV byte and per call inside the decode
step, the chain's hand-offs, and a GPU's device<->host copy bandwidth.

The S-worker's own tier is the backend's last worker (rpart/tiered.py), on rank 0 like local
mode's store: local mode is told by the R-workers (the workers that are not the tier) being rank
0, and the timings of the S-part and of the chain run on the R-workers only, so that the tier's
attention, which the model puts on the S side itself, is not counted in them.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from fastdecode.engine.harness import (
    SYNTHETIC_SEQ_BASE,
    fake_sequences,
    first_layers,
    median_time,
    placed_sequences,
    sync,
)
from fastdecode.engine.llm_engine import LLMEngine
from fastdecode.engine.runner import ModelRunner
from fastdecode.engine.sampler import SamplingBatch, sample
from fastdecode.engine.sampling_params import SamplingParams
from fastdecode.rpart.loopback import LoopbackBackend
from fastdecode.sizing.model import layer_times
from fastdecode.sizing.schema import Profile

# Steps of at most 1.5x from 512 up: the per-token cost is not smooth in the prompt length (dev VM,
# chunks of ~8192: 1.5 / 1.7 / 3.2 ms at 512 / 768 / 1024), so a 2x step misprices what lies between.
PROMPT_GRID = [16, 128, 256, 512, 768, 1024, 1536, 2048]
MIN_TIMED_S = 1.0               # a timing repeats until it spans this long (shared hosts drift)


def r_worker_indices(engine: LLMEngine) -> list[int]:
    """The backend's workers that are R-workers (or local mode's store): all but the S-worker's own tier."""
    return [i for i, w in enumerate(engine.backend.workers) if not w.tier]


def local_mode(engine: LLMEngine) -> bool:
    """The R-part runs in this process (no MPI R-worker): no link, no hand-offs. The S-worker's own
    tier, rank 0 too, does not make a job local."""
    workers = engine.backend.workers
    return not any(workers[i].rank for i in r_worker_indices(engine))


def r_worker_sequences(engine: LLMEngine, count: int, prompt_len: int, first_id: int):
    """placed_sequences, spread over the R-workers only (round-robin), the tier left empty."""
    seqs = placed_sequences(engine, count, prompt_len, first_id)
    ws = r_worker_indices(engine)
    for i, s in enumerate(seqs):
        s.worker = ws[i % len(ws)]
    return seqs


def pcie_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float]:
    """(device->host, host->device) bytes/s of pinned copies running at once on two streams, as
    the S-worker's transport runs them; (0, 0) for a CPU S-worker (no such hop)."""
    if device.type != "cuda":
        return 0.0, 0.0
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dev_b = torch.empty_like(dev_a)
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)
    best = [0.0, 0.0]
    for _ in range(repeats + 1):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize(device)
        for i, (stream, dst, src) in enumerate(zip(streams, (host_a, dev_b), (dev_a, host_b))):
            with torch.cuda.stream(stream):
                events[2 * i].record(stream)
                dst.copy_(src, non_blocking=True)
                events[2 * i + 1].record(stream)
        torch.cuda.synchronize(device)
        for i in range(2):
            best[i] = max(best[i], nbytes / (events[2 * i].elapsed_time(events[2 * i + 1]) / 1e3))
    return best[0], best[1]


@torch.inference_mode()
def time_s_part_device(engine: LLMEngine, batch: int, repeats: int = 3) -> tuple[float, float]:
    """(seconds per layer, seconds per step besides the layers) of a GPU S-worker at `batch` rows.

    On a GPU the host only queues kernels and then waits, so its busy time says nothing: time
    the device instead. The engine's own decode step through a loopback that moves nothing (the
    device<->host copies belong to the link, measured apart); per layer is the slope between the
    model's first half and all of its layers, and the rest of the step (embedding, the host's
    bookkeeping, LM head, sampling) is the per-step remainder."""
    m, c = engine.model, engine.config
    loop = LoopbackBackend(c.num_heads, c.head_dim, m.device, m.dtype, transfers=False)
    runner = ModelRunner(m, loop, engine.eos_ids, depth=1, graphs=engine.runner.graphs)   # as the job runs
    seqs = fake_sequences(batch, 16, c.vocab_size, SYNTHETIC_SEQ_BASE)
    full = median_time(lambda: runner.decode(seqs), m.device, repeats)
    half = c.num_layers // 2
    if half < 1:                                       # one layer: no slope; the LM head apart
        x = torch.randn(batch, c.hidden_size, device=m.device).to(m.dtype)
        rows = SamplingBatch([(SamplingParams(temperature=0, max_tokens=1), 0, 0, 0, None)] * batch, m.device)
        head = median_time(lambda: sample(m.logits(x), rows), m.device, repeats)
        return max(full - head, 1e-9), head
    with first_layers(m, half):
        part = median_time(lambda: runner.decode(seqs), m.device, repeats)
    per_layer = max(full - part, 1e-9) / (c.num_layers - half)
    return per_layer, max(full - c.num_layers * per_layer, 1e-9)


# the S-part timing's sequences: prompt + first token + a warm-up + the timed steps stay within one
# 32-token page, so a CPU profile times as large a batch as the R-workers' memory can hold
S_PART_PROMPT = 8               # tokens of context of the S-part timing's sequences
S_PART_MAX_STEPS = 20           # decode steps it times at most (each appends a token to every sequence)


@torch.inference_mode()
def time_s_part(engine: LLMEngine, batch: int, repeats: int = 3, min_timed_s: float = MIN_TIMED_S
                ) -> tuple[float, float]:
    """(seconds per layer, seconds for LM head + sampling) of the S-worker in a decode step at
    `batch` rows, one mini-batch (the sizing model composes mini-batches itself).

    The step is the engine's own (ModelRunner.decode) on the job's real R-workers and transport,
    over sequences of 8 to 30 tokens, so the R-part is short and the S-worker's busy time (the step
    less its waits for replies) carries everything it pays per layer: RoPE, packing, staging,
    MPI calls, its progress thread, a core shared with nothing else. Per layer = (busy - head) / layers.
    """
    m, c = engine.model, engine.config
    runner = ModelRunner(m, engine.backend, engine.eos_ids, depth=1)
    seqs = r_worker_sequences(engine, batch, S_PART_PROMPT, SYNTHETIC_SEQ_BASE)
    runner.prefill(seqs)
    x = torch.randn(batch, c.hidden_size, device=m.device).to(m.dtype)
    rows = SamplingBatch([(SamplingParams(temperature=0, max_tokens=1), 0, 0, 0, None)] * batch, m.device)
    head_s = median_time(lambda: sample(m.logits(x), rows), m.device, repeats, min_timed_s / 4)
    runner.decode(seqs)                   # a warm-up (buffers grow)
    busy, start = [], time.perf_counter()
    while len(busy) < repeats or (time.perf_counter() - start < min_timed_s and len(busy) < S_PART_MAX_STEPS):
        runner.decode(seqs)
        busy.append(runner.last_s_time)
    engine.free_kv(seqs)
    return max(float(np.median(busy)) - head_s, 1e-9) / c.num_layers, head_s


@torch.inference_mode()
def time_prefill(engine: LLMEngine, prompt_len: int, chunk_tokens: int, min_timed_s: float = MIN_TIMED_S) -> float:
    """Seconds per prompt token of a prefill chunk of `prompt_len`-token prompts: the engine's
    ModelRunner.prefill (dense layers, causal attention over the prompt, K/V shipped to the
    R-workers, first-token sampling), in chunks of as many whole prompts as fit `chunk_tokens`."""
    m = engine.model
    runner = ModelRunner(m, engine.backend, engine.eos_ids, depth=1)
    warm = placed_sequences(engine, 1, 8, SYNTHETIC_SEQ_BASE)
    runner.prefill(warm)
    engine.free_kv(warm)
    count = max(1, chunk_tokens // prompt_len)
    times = []
    while not times or sum(times) < min_timed_s / 4:   # a GPU chunk takes milliseconds: repeat, take the median
        seqs = placed_sequences(engine, count, prompt_len, SYNTHETIC_SEQ_BASE)
        sync(m.device)
        t = time.perf_counter()
        runner.prefill(seqs)
        sync(m.device)
        times.append(time.perf_counter() - t)
        engine.free_kv(seqs)
    return float(np.median(times)) / (count * prompt_len)


PREFILL_CHUNK_PROMPT = 128      # prompt length of the chunk-size table: the dense part dominates


def prompts_that_fit(engine: LLMEngine, prompt_len: int, r_workers_only: bool = False) -> int:
    """How many `prompt_len`-token prompts the workers' memory holds at once, spread round-robin
    as placed_sequences spreads them (every layer's KV, whole pages, a tenth kept free): a prefill chunk
    the profile times must fit, as a job's chunks do (admission only prefills what fits).
    r_workers_only: spread over the R-workers alone (r_worker_sequences)."""
    c, workers = engine.config, engine.backend.workers
    if r_workers_only:
        workers = [workers[i] for i in r_worker_indices(engine)]
    token_bytes = c.kv_bytes_per_token(engine.kv_dtype)
    per_worker = min(int(0.9 * w.capacity_bytes // token_bytes) // (-(-prompt_len // max(w.page_tokens, 1))
                                                                   * max(w.page_tokens, 1)) for w in workers)
    return per_worker * len(workers)


def prefill_grids(engine: LLMEngine, prompt_lens: list[int] | None) -> dict:
    """What time_prefill_grids times: the prompt lengths at the FIFO chunk (`chunk`), the chunk
    sizes at `chunk_prompt` tokens, and the distinct (prompt length, prompts per chunk) points."""
    c, cap = engine.config, engine.args.max_prefill_tokens
    max_prompt = min(c.max_position, cap)
    cp = min(PREFILL_CHUNK_PROMPT, max_prompt)
    prompt_grid = [p for p in prompt_lens or PROMPT_GRID if p <= max_prompt and prompts_that_fit(engine, p)]
    if not prompt_grid or not prompts_that_fit(engine, cp):
        raise ValueError(f"the R-workers' memory ({min(w.capacity_bytes for w in engine.backend.workers):,} bytes "
                         f"of KV on the smallest) cannot hold the profile's prompts (--rworker-mem too small)")
    base = min(cap, 16384) if engine.device.type == "cuda" else cap
    chunk_grid = sorted({max(cp, min(cap, x, prompts_that_fit(engine, cp) * cp)) // cp * cp
                         for x in (base // 4, base, base * 4)})

    def point(prompt: int, chunk: int) -> tuple[int, int]:
        return prompt, max(1, min(chunk // prompt, prompts_that_fit(engine, prompt)))

    points = [point(p, max(base, p)) for p in prompt_grid] + [point(cp, x) for x in chunk_grid]
    return {"prompt_grid": prompt_grid, "chunk": base, "chunk_prompt": cp, "chunk_grid": chunk_grid,
            "points": list(dict.fromkeys(points)), "point": point}


def time_prefill_grids(engine: LLMEngine, prompt_lens: list[int] | None, log,
                       min_timed_s: float = MIN_TIMED_S) -> dict:
    """SWorkerProfile's prefill tables: seconds per prompt token over prompt lengths at the chunk a
    FIFO job prefills in (--max-prefill-tokens; at most 16,384 on a GPU, to bound the profile's
    time), and over chunk sizes (a quarter of that, it, four times it, capped the same way) at a
    128-token prompt, for smaller chunks (the stabilized schedule's micro-batches). Chunks are
    capped at what the R-workers' memory holds (--rworker-mem), as a job's are.
    Prompt length and chunk do not separate on a CPU (dev VM: 768-token prompts cost 2.1 ms per
    token one at a time and 1.7 ten at a time, 512-token ones 1.2 and 1.5 sixteen at a time;
    bench/sizing/prefill_chunk_probe.py), so the prompt table is measured at the chunk FIFO uses rather
    than shifted to it."""
    g = prefill_grids(engine, prompt_lens)
    base, cp, seen = g["chunk"], g["chunk_prompt"], {}

    def timed(prompt: int, chunk: int) -> float:
        key = g["point"](prompt, chunk)
        if key not in seen:
            seen[key] = time_prefill(engine, prompt, key[0] * key[1], min_timed_s)
            log(f"prefill prompt={prompt:>5} chunk={key[0] * key[1]:>6}: {seen[key] * 1e6:8.2f} us per prompt token"
                + (" (capped: what the R-workers' memory holds)" if key[1] < chunk // prompt else ""))
        return seen[key]

    return {"prefill_prompt_len": g["prompt_grid"],
            "prefill_token_s": [timed(p, max(base, p)) for p in g["prompt_grid"]],
            "prefill_chunk": base, "prefill_chunk_prompt_len": cp,
            "prefill_chunk_grid": g["chunk_grid"], "prefill_chunk_token_s": [timed(cp, x) for x in g["chunk_grid"]]}


IN_STEP_STEPS = 5            # decode steps per in-step timing
IN_STEP_SHORT = 64           # tokens of context of the short in-step timing


@torch.inference_mode()
def _busy_per_call(engine: LLMEngine, seqs_per_worker: int, context: int) -> list[tuple[float, float]]:
    """Per R-worker (KV bytes, busy seconds) of one attention call (one layer, one mini-batch) in
    the engine's decode steps, every worker (the S-worker's own tier too) holding `seqs_per_worker`
    sequences of `context` tokens (synthetic K/V shipped as a prefill ships them; no model compute). Steps over one and
    over two layers: their difference is one layer's calls, so what a worker pays once per step
    (the control message, its buffers, the stats reply) is not charged to the calls."""
    be, m, c = engine.backend, engine.model, engine.config
    depth = engine.args.pipeline_depth
    token_bytes = c.kv_bytes_per_token(engine.kv_dtype) // c.num_layers       # K+V, one layer
    seqs = placed_sequences(engine, seqs_per_worker * be.num_workers, 1, SYNTHETIC_SEQ_BASE + (1 << 40))
    for s in seqs:
        s.request.prompt_ids = [1] * context            # only the length matters: K/V are synthetic
    seqs.sort(key=lambda s: s.worker)
    runner = ModelRunner(m, be, engine.eos_ids, depth)
    gen = torch.Generator(device=m.device).manual_seed(0)
    with first_layers(m, 2):
        chunk = max(1, 32768 // context)                # prompts per shipment, bounded device memory
        for i in range(0, len(seqs), chunk):
            part = seqs[i:i + chunk]
            counts = [sum(s.worker == w for s in part) * context for w in range(be.num_workers)]
            be.prefill_begin(np.repeat([s.seq_id for s in part], context).astype(np.int64), counts, 2)
            shape = (len(part) * context, c.num_kv_heads, c.head_dim)
            for layer in range(2):
                k = torch.randn(shape, device=m.device, generator=gen).to(m.dtype)
                v = torch.randn(shape, device=m.device, generator=gen).to(m.dtype)
                be.prefill_layer(layer, k, v)
            be.prefill_end()
    busy = {}
    for layers in (1, 2, 1, 2):                         # interleaved: drift hits both alike
        with first_layers(m, layers):
            for step in range(IN_STEP_STEPS + 1):       # the first is a warm-up
                _, _, stats = runner.decode(seqs)
                if step:
                    busy.setdefault(layers, []).append(stats.busy_s)
    engine.free_kv(seqs)
    kv_bytes = [0] * be.num_workers      # layer 1 has grown by one token per two-layer step: half of them on average
    for s in seqs:
        kv_bytes[s.worker] += (context + (IN_STEP_STEPS + 1)) * token_bytes
    per_layer = np.median(np.array(busy[2]), axis=0) - np.median(np.array(busy[1]), axis=0)
    return [(kb / depth, max(float(t), 0.0) / depth) for kb, t in zip(kv_bytes, per_layer)]


def time_r_part_in_step(engine: LLMEngine, seqs_per_worker: int, target_bytes: int) -> list[tuple[float, float]] | None:
    """Each R-worker's (seconds per KV byte, seconds per call) as it pays them inside the engine's
    decode step: the kernel timed alone (measure_attention) misses what a real step adds (the
    append, MPI copies in and out, the progress threads, the S-worker and the other R-workers on
    the same memory and cores). Busy time per call at a short and at a long context (about
    `target_bytes` of KV per layer per worker), a line through the two. None in local mode
    (the R-part runs in-process: the kernel's own time is the R-part)."""
    be, c = engine.backend, engine.config
    if not be.workers or local_mode(engine) or c.num_layers < 2:
        return None
    token_bytes = c.kv_bytes_per_token(engine.kv_dtype) // c.num_layers
    room = min(w.capacity_bytes for w in be.workers) * 0.8 / (2 * seqs_per_worker * token_bytes)
    long_ctx = int(min(target_bytes / (seqs_per_worker * token_bytes), room,
                       c.max_position - 4 * (IN_STEP_STEPS + 1) - 2))
    short_ctx = min(IN_STEP_SHORT, long_ctx // 4)
    if short_ctx < 8:
        return None
    short = _busy_per_call(engine, seqs_per_worker, short_ctx)
    long = _busy_per_call(engine, seqs_per_worker, long_ctx)
    fits = []
    for (b1, t1), (b2, t2) in zip(short, long):
        per_byte = max((t2 - t1) / (b2 - b1), 1e-15)
        fits.append((per_byte, max(t1 - per_byte * b1, 0.0)))
    return fits


HOP_PROMPT = 16               # tokens of context of the chain-hop timing's sequences


@torch.inference_mode()
def time_chain_hop(engine: LLMEngine, profile: Profile, steps: int = IN_STEP_STEPS, log=print) -> float:
    """Seconds per layer that one mini-batch's chain S -> link -> R -> link takes beyond the
    parts the profile has already measured (LinkProfile.hop_s): waiting ranks waking up, the
    progress threads' polling, a device event handed to MPI. Busy times and pings miss them;
    they bound a layer where a mini-batch's work is small (a GPU S-worker at small batch on few
    R-workers). Decode steps at depth 1 (a layer is its chain) of one short sequence per
    R-worker (none on the S-worker's own tier), over one and over two layers, interleaved: their
    difference is one layer's chain, less the modelled s + r + link at that size. 0 in local mode
    (no hand-offs)."""
    be, m, c = engine.backend, engine.model, engine.config
    if not be.workers or local_mode(engine) or c.num_layers < 2:
        return 0.0
    n = len(r_worker_indices(engine))
    seqs = r_worker_sequences(engine, n, HOP_PROMPT, SYNTHETIC_SEQ_BASE + (2 << 40))
    runner = ModelRunner(m, be, engine.eos_ids, depth=1, graphs=engine.runner.graphs)   # as the job runs
    wall = {1: [], 2: []}
    with first_layers(m, 2):
        runner.prefill(seqs)
    for layers in (1, 2):                                # warm-ups (and CUDA graph captures)
        with first_layers(m, layers):
            runner.decode(seqs)
    for layers in (1, 2) * 3:
        with first_layers(m, layers):
            for _ in range(steps):
                t = time.perf_counter()
                runner.decode(seqs)
                wall[layers].append(time.perf_counter() - t)
    engine.free_kv(seqs)
    per_layer = float(np.median(wall[2]) - np.median(wall[1]))
    no_tier = dataclasses.replace(profile, device_tier=None)          # these sequences are all on R-workers
    modelled = layer_times(no_tier, n, 2 * HOP_PROMPT, 0, n, 1)["layer"]   # s + r + link, no hop
    log(f"chain of {n} sequence(s), depth 1: {per_layer * 1e6:.1f} us per layer, the measured parts "
        f"{modelled * 1e6:.1f} us: hand-offs {max(per_layer - modelled, 0.0) * 1e6:.1f} us")
    return max(per_layer - modelled, 0.0)

