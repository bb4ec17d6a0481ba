"""Ranges of the engine's flags: a value that is not a number, not finite, or outside what a job
can use is refused with exit 2 naming the flag, before anything starts; the Python API (`LLM`)
applies the same ranges to its keyword arguments (`engine_args_error`), as a ValueError.

Durations and counts are read by argparse (`duration`, engine_options.positive_int), through the
same rules; sizes are checked against the machine each rank runs on (`machine_error`, on every
rank before MPI's start-up, so an R-worker's node answers for its own --rworker-mem).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_DURATION_S = 30 * 86400.0     # a month: past it a duration is no bound at all
MIN_TIMEOUT_S = 1.0               # --timeout: below a step's time every rank would be "silent"
MIN_PROGRESS_S = 0.01             # --progress-interval


def seconds_range_error(value: float, least: float) -> str | None:
    """What a duration must be, where `value` is not (finite, in [least, MAX_DURATION_S])."""
    if not (math.isfinite(value) and least <= value <= MAX_DURATION_S):
        return f"expected seconds in [{least:g}, {MAX_DURATION_S:g}]"
    return None


def count_range_error(value: int, most: int | None = None) -> str | None:
    """What a count must be, where `value` is not (at least 1, at most `most`)."""
    if value < 1:
        return "expected a positive integer"
    if most is not None and value > most:
        return f"expected at most {most}"
    return None


def duration(least: float) -> Callable[[str], float]:
    """An argparse type: seconds, finite, in [least, MAX_DURATION_S]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        error = seconds_range_error(value, least)
        if error:
            raise argparse.ArgumentTypeError(f"{error}, got {text!r}")
        return value
    return parse


def gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


# size flags that bound memory, with their defaults: (flag, dest, default or None, checked where)
SIZE_FLAGS = (("--rworker-mem", "rworker_mem", None, "kv"),
              ("--r-bytes", "r_bytes", None, "kv"),                     # profile's KV per R-worker timing
              ("--max-request-mem", "max_request_mem", 1 << 30, "rank0"),
              ("--max-inflight-mem", "max_inflight_mem", 4 << 30, "rank0"),
              ("--max-line-bytes", "max_line_bytes", 16 << 20, "rank0"))


def machine_error(args, rank: int, roles, total_bytes: int | None = None) -> str | None:
    """The first size flag larger than this machine's memory, named with both; None if all fit.
    --rworker-mem is checked where KV is held (an R-worker; rank 0 in local mode: roles, a
    launch.ranks.Roles), the rank-0 limits on rank 0; a default is never refused (it may exceed a
    small machine unused)."""
    if total_bytes is None:
        import psutil
        total_bytes = psutil.virtual_memory().total
    holds_kv = roles.holds_kv(rank)
    for flag, dest, default, where in SIZE_FLAGS:
        value = getattr(args, dest, None)
        if value is None or value == default or (where == "kv" and not holds_kv) or (where == "rank0" and rank):
            continue
        if value > total_bytes:
            return f"{flag} {gib(value)} is more than this machine's memory ({gib(total_bytes)})"
    return None


# EngineArgs fields with the flag that sets them and its range: a count (at least 1, and at most
# the bound where one is given), "seconds" (at least the bound), "bytes" (a positive count the
# machine must hold: machine_error), "fraction" (0, 1] or "int" (any integer)
ENGINE_RANGES = (
    ("max_batch", "--max-batch", "count", None), ("max_prefill_tokens", "--max-prefill-tokens", "count", None),
    ("max_num_batched_tokens", "--max-num-batched-tokens", "count", None),
    ("max_model_len", "--max-model-len", "count", None), ("s_threads", "--s-threads", "count", None),
    ("r_threads", "--r-threads", "count", None), ("target_batch", "--target-batch", "count", None),
    ("admit_every", "--admit-every", "count", None), ("max_gen", "--max-gen", "count", None),
    ("pipeline_depth", "--pipeline-depth", "count", "MAX_MINIBATCHES"),
    ("cuda_graph_max_rows", "--cuda-graph-max-rows", "count", None),
    ("max_logprobs", "--max-logprobs", "count", None), ("prefix_kept_tokens", "--prefix-kept-tokens", "count", None),
    ("tensor_parallel_size", "--tensor-parallel-size", "count", None),
    ("timeout", "--timeout", "seconds", MIN_TIMEOUT_S), ("seed", "--seed", "int", None),
    ("rworker_mem", "--rworker-mem", "bytes", None), ("max_request_mem", "--max-request-mem", "bytes", None),
    ("device_kv_memory", "--device-kv-memory", "bytes", None),
    ("gpu_memory_utilization", "--gpu-memory-utilization", "fraction", None),
)


def engine_args_error(args) -> str | None:
    """The first EngineArgs field outside its flag's range, as one line naming the field and the
    flag; None if all are in range. A field left at None takes its default."""
    for field, flag, kind, bound in ENGINE_RANGES:
        value = getattr(args, field)
        if value is None:
            continue
        error = _range_error(value, kind, bound)
        if error:
            return f"{field}={value!r}: {error}, as {flag} takes"
    return None


def _range_error(value, kind: str, bound) -> str | None:
    numeric = kind in ("seconds", "fraction")
    if isinstance(value, bool) or not isinstance(value, (int, float) if numeric else int):
        return "expected a number" if numeric else "expected an integer"
    if kind == "seconds":
        return seconds_range_error(float(value), bound)
    if kind == "fraction":
        return None if 0 < value <= 1 else "expected a fraction in (0, 1]"
    if kind == "int":
        return None
    if bound == "MAX_MINIBATCHES":
        from rworker.protocol.control import MAX_MINIBATCHES
        bound = MAX_MINIBATCHES
    return count_range_error(value, bound)
