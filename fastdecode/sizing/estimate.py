"""How long `fastdecode profile` will take, said before it starts.

Each timing's cost follows from its grid (profile.py, measure.py) and two costs calibrated on
the job's own engine in a second or two: a decode step at one sequence, and what a token adds
to a step (a further sequence of a decode step, a prompt token of a prefill). The R-workers' timings cost what generating
and streaming their KV costs (constants below, from the dev VM). An estimate, within a factor of
about two: it lets a user pick --quick or a smaller grid before waiting minutes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from fastdecode.engine.harness import SYNTHETIC_SEQ_BASE, placed_sequences, sync
from fastdecode.engine.llm_engine import LLMEngine
from fastdecode.engine.runner import ModelRunner
from fastdecode.sizing.measure import (
    IN_STEP_STEPS,
    S_PART_MAX_STEPS,
    S_PART_PROMPT,
    local_mode,
    prefill_grids,
    prompts_that_fit,
    r_worker_indices,
)
from fastdecode.sizing.profile import ProfileSettings, s_part_grid
from rworker.bench import default_target_bytes

NUMPY_RNG_BYTES_PER_S = 70e6     # random KV an R-worker's kernel timing makes and stores (numpy, one thread; dev VM)
TORCH_RNG_BYTES_PER_S = 300e6    # random K/V the S-worker ships for the in-step timing (torch.randn; dev VM)
ATTEND_BYTES_PER_S = 3e9         # KV an R-worker's attention streams in a step
LINK_BYTES_PER_S = 2e9           # a message's bytes between ranks (shared memory; a network is near it)
CALIBRATION_PROMPT = 128         # tokens of a calibration prompt
CALIBRATION_SEQ_BASE = SYNTHETIC_SEQ_BASE + (3 << 40)


@dataclass
class PointCosts:
    step_s: float            # a decode step at one sequence, every layer
    token_s: float           # what each further sequence adds to a step, or a prompt token to a prefill
    calibration_s: float     # what measuring these took

    def step(self, rows: int) -> float:
        return self.step_s + max(rows - 1, 0) * self.token_s

    def prefill(self, tokens: int) -> float:
        return self.step_s + tokens * self.token_s


@torch.inference_mode()
def calibrate(engine: LLMEngine, prompt: int = CALIBRATION_PROMPT) -> PointCosts:
    """A decode step at one sequence, and a prefill of one `prompt`-token prompt (a CPU) or of
    eight (a GPU, where fewer tokens cost no more than launching the kernels): the per-token
    cost of the dense layers at a useful batch. Extrapolating decode steps at 1 and 16 sequences
    instead overstated larger batches twofold on a CPU (the GEMMs get more efficient)."""
    start = time.perf_counter()
    runner = ModelRunner(engine.model, engine.backend, engine.eos_ids, depth=1)
    seqs = placed_sequences(engine, 1, S_PART_PROMPT, CALIBRATION_SEQ_BASE)
    runner.prefill(seqs)
    runner.decode(seqs)                                      # a warm-up
    step = min(_timed(lambda: runner.decode(seqs), engine.device) for _ in range(2))
    engine.free_kv(seqs)
    count = max(1, min(8 if engine.device.type == "cuda" else 1, prompts_that_fit(engine, prompt)))
    prefill = []
    for _ in range(2):                                       # the first at this size pays for its buffers
        seqs = placed_sequences(engine, count, prompt, CALIBRATION_SEQ_BASE)
        prefill.append(_timed(lambda seqs=seqs: runner.prefill(seqs), engine.device))
        engine.free_kv(seqs)
    token = max(min(prefill) - step, 0.0) / (count * prompt)
    return PointCosts(step, token, time.perf_counter() - start)


def _timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def estimate(engine: LLMEngine, settings: ProfileSettings) -> tuple[dict[str, float], PointCosts]:
    """Seconds each part of the profile should take (S-part, prefill, R-workers, link), and the
    calibrated costs. The grids come first: one the R-workers' memory cannot hold is an error
    before anything runs."""
    st = settings
    grid = s_part_grid(engine, st.batches)
    points = prefill_grids(engine, st.prompt_lens)["points"]
    c = calibrate(engine, min(CALIBRATION_PROMPT, max(p for p, _ in points)))
    cuda = engine.device.type == "cuda"
    layers = engine.config.num_layers
    s_part = 0.0
    for b in grid:
        step = c.step(b)
        if cuda:                                             # full and half model, repeats each, a warm-up
            s_part += 1.5 * (1 + st.repeats) * step
        else:                                                # prefill, the head timing, warm-up + timed steps
            n = max(st.repeats, min(S_PART_MAX_STEPS, math.ceil(st.min_timed_s / max(step, 1e-9))))
            s_part += c.prefill(S_PART_PROMPT * b) + st.min_timed_s / 4 + (1 + n) * step
    prefill = 0.0
    for prompt, count in points:
        chunk = c.prefill(prompt * count)
        prefill += c.prefill(8) + max(1, math.ceil(st.min_timed_s / 4 / max(chunk, 1e-9))) * chunk
    target = st.r_bytes or default_target_bytes()
    r_part = target / NUMPY_RNG_BYTES_PER_S + 6 * target / ATTEND_BYTES_PER_S     # every worker at once
    link = 0.0
    workers = engine.backend.workers
    if workers and not local_mode(engine):                   # under MPI: the in-step timing, pings, hand-offs
        part = 2 / max(layers, 1)                            # those steps run one or two layers
        rows = st.r_seqs * len(workers)                      # the S-worker's own tier is timed in the step too
        r_part += 2 * target * len(workers) / TORCH_RNG_BYTES_PER_S
        r_part += 8 * (IN_STEP_STEPS + 1) * (c.step(rows) * part + 1.5 * target / ATTEND_BYTES_PER_S)
        workers = [workers[i] for i in r_worker_indices(engine)]     # ... but puts nothing on the link
        link = len(workers) * sum(st.link_sizes) * 2 * max(st.repeats, 5) / LINK_BYTES_PER_S
        if len(workers) > 1:                                 # the two largest to all workers at once
            link += len(workers) * sum(sorted(st.link_sizes)[-2:]) * 2 * max(st.repeats, 5) / LINK_BYTES_PER_S
        link += (2 + 6 * IN_STEP_STEPS) * c.step(len(workers)) * part
    return {"S-part": s_part, "prefill": prefill, "R-workers": r_part, "link": link}, c


def estimate_line(parts: dict[str, float], costs: PointCosts, quick: bool) -> str:
    total = sum(parts.values())
    each = ", ".join(f"{name} {sec:.0f} s" for name, sec in parts.items())
    return (f"profile: about {total:.0f} s to run ({each}; from a {costs.calibration_s:.1f} s calibration)"
            + ("" if quick else "; --quick takes a smaller grid"))
