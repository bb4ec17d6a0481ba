"""How a CPU S-rank's torch threads are bound to cores, for its start-up line and `fastdecode info`.

torch's CPU ops run on OpenMP threads (libgomp), which read OMP_PROC_BIND and OMP_PLACES once,
when torch loads the runtime. fastdecode sets neither. Bound ("close" over "cores", as vLLM binds
its CPU workers) and sharing cores with the in-process R-part's pinned kernel threads (local mode,
where S and R take turns), libgomp's threads spin at their barrier on a core a kernel thread
needs and neither can move: a small local job ran 2.7x slower on the dev box than unbound
(docs/tuning.md). An S-worker with cores of its own (R-workers on other cores or nodes) may bind
them by exporting both variables before the job starts; the start-up line then says so.
"""
from __future__ import annotations

import os

BOUND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


def binding(env=None) -> str:
    """How this process's torch threads are bound: unbound, or the OMP_* values given."""
    env = os.environ if env is None else env
    given = {k: env[k] for k in BOUND if env.get(k)}
    if not given:
        return "unbound (OMP_PROC_BIND/OMP_PLACES unset)"
    return "bound (" + ", ".join(f"{k}={v}" for k, v in given.items()) + ")"
