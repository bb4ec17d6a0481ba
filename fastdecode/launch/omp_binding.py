"""How a CPU S-rank's torch threads are bound to cores, for its start-up line and `fastdecode info`.

torch's CPU ops run on OpenMP threads (libgomp), which read OMP_PROC_BIND and OMP_PLACES once,
when torch loads the runtime. fastdecode sets neither. Bound ("close" over "cores", as vLLM binds
its CPU workers) and sharing cores with the in-process R-part's pinned kernel threads (local mode,
where S and R take turns), libgomp's threads spin at their barrier on a core a kernel thread
needs and neither can move: a small local job ran 2.7x slower on the dev box than unbound
(docs/tuning.md). An S-worker with cores of its own (R-workers on other cores or nodes) may bind
them by exporting both variables before the job starts; the start-up line then says so.

How long a thread spins at libgomp's barrier before it sleeps is GOMP_SPINCOUNT, also read once.
Its default (300,000 spins, about a millisecond) suits a machine with nothing else on it; with one
other process on a core, a thread spins away whole time slices while the thread it waits for
cannot run: local mode (S and R taking turns on every core) ran 12x slower on the dev box with two
busy processes beside it. 2,000 spins (a few microseconds) cost nothing on a quiet box, where a
parallel op's threads meet within that, and kept the loaded job at 1.05x the speed of S and R on
separate cores (bench/e2e/local_depth_bench.py); in a trial 200 put every op's threads to sleep
and halved a quiet job.
`spin_default()` sets it where the user has not, before torch loads (fastdecode/__init__.py).
"""
from __future__ import annotations

import os
import sys

BOUND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
SPIN = "GOMP_SPINCOUNT"
SPIN_DEFAULT = "2000"
_spin_set_by_us = False


def spin_default() -> None:
    """GOMP_SPINCOUNT=2000 unless given, while torch (and with it libgomp) is not loaded yet."""
    global _spin_set_by_us
    if SPIN not in os.environ and "torch" not in sys.modules:
        os.environ[SPIN] = SPIN_DEFAULT
        _spin_set_by_us = True


def spin(env=None) -> str:
    """How long torch's threads spin at a barrier, for the start-up line."""
    env = os.environ if env is None else env
    if env.get(SPIN):
        return f"{SPIN}={env[SPIN]}" + (" (fastdecode's default)" if _spin_set_by_us and env is os.environ else "")
    return "libgomp's default spin (torch was loaded before fastdecode; export GOMP_SPINCOUNT=2000 on a shared node)"


def binding(env=None) -> str:
    """How this process's torch threads are bound: unbound, or the OMP_* values given."""
    env = os.environ if env is None else env
    given = {k: env[k] for k in BOUND if env.get(k)}
    if not given:
        return "unbound (OMP_PROC_BIND/OMP_PLACES unset)"
    return "bound (" + ", ".join(f"{k}={v}" for k, v in given.items()) + ")"
