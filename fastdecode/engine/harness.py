"""Drive the engine's own runner over synthetic sequences, to time it (`fastdecode profile`, the
benchmarks): sequences of a chosen context placed on the R-workers round-robin (placement's
accounting is bypassed: a timing fills the workers evenly, whatever their load), the model cut
to its first layers, and a median timer that waits for the device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import torch

from fastdecode.engine.llm_engine import LLMEngine
from fastdecode.engine.sampling_params import SamplingParams
from fastdecode.engine.sequence import Request, Sequence, Status

SYNTHETIC_SEQ_BASE = 1 << 48     # ids of synthetic sequences, clear of the engine's own


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, repeats: int, min_seconds: float = 0.0) -> float:
    """Median seconds of fn() over at least `repeats` calls, and over at least `min_seconds` of
    calls, after one warm-up (device work included)."""
    fn()
    sync(device)
    times = []
    while len(times) < repeats or sum(times) < min_seconds:
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def fake_sequences(count: int, prompt_len: int, vocab: int, first_id: int = 1) -> list[Sequence]:
    """`count` running sequences with `prompt_len` tokens of context each (token ids arbitrary)."""
    rng = np.random.default_rng(prompt_len)
    seqs = []
    for i in range(count):
        ids = rng.integers(0, vocab, prompt_len).tolist()
        req = Request(i, str(i), None, ids, SamplingParams(max_tokens=8, temperature=0), seed=i)
        seqs.append(Sequence(first_id + i, req, 0, 8, output_ids=[int(rng.integers(0, vocab))],
                             status=Status.RUNNING, worker=0))
    return seqs



def placed_sequences(engine: LLMEngine, count: int, prompt_len: int, first_id: int) -> list[Sequence]:
    """`count` synthetic sequences spread over the engine's R-workers round-robin; hand them back
    with engine.free_kv when done."""
    seqs = fake_sequences(count, prompt_len, engine.config.vocab_size, first_id)
    for i, s in enumerate(seqs):
        s.worker = i % engine.backend.num_workers
    return seqs


@contextlib.contextmanager
def first_layers(model, count: int):
    """Run `model` as if it had only its first `count` layers."""
    config, layers = model.config, model.layers
    model.config, model.layers = dataclasses.replace(config, num_layers=count), layers[:count]
    try:
        yield
    finally:
        model.config, model.layers = config, layers

