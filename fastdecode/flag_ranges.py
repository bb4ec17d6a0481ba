"""Ranges of the duration and size flags: a value that is not a number, not finite, or outside
what a job can use is refused with exit 2 naming the flag, before anything starts.

Durations are read by argparse (`duration`); sizes are checked against the machine each rank
runs on (`machine_error`, on every rank before MPI's start-up, so an R-worker's node answers for
its own --rworker-mem).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_DURATION_S = 30 * 86400.0     # a month: past it a duration is no bound at all
MIN_TIMEOUT_S = 1.0               # --timeout: below a step's time every rank would be "silent"
MIN_PROGRESS_S = 0.01             # --progress-interval


def duration(least: float) -> Callable[[str], float]:
    """An argparse type: seconds, finite, in [least, MAX_DURATION_S]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not (math.isfinite(value) and least <= value <= MAX_DURATION_S):
            raise argparse.ArgumentTypeError(f"expected seconds in [{least:g}, {MAX_DURATION_S:g}], got {text!r}")
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


def machine_error(args, rank: int, size: int, total_bytes: int | None = None) -> str | None:
    """The first size flag larger than this machine's memory, named with both; None if all fit.
    --rworker-mem is checked where KV is held (an R-worker; rank 0 alone in local mode), the
    rank-0 limits on rank 0; a default is never refused (it may exceed a small machine unused)."""
    if total_bytes is None:
        import psutil
        total_bytes = psutil.virtual_memory().total
    holds_kv = rank > 0 or size <= 1
    for flag, dest, default, where in SIZE_FLAGS:
        value = getattr(args, dest, None)
        if value is None or value == default or (where == "kv" and not holds_kv) or (where == "rank0" and rank):
            continue
        if value > total_bytes:
            return f"{flag} {gib(value)} is more than this machine's memory ({gib(total_bytes)})"
    return None
