"""The `FASTDECODE_*` variables, checked once at start-up on every rank.

Each variable is read where it acts (the modules named in docs/tuning.md), and most of those
readers fall back to a default on a value they do not know, silently: a typo such as
`FASTDECODE_WAIT=slep` would change nothing and say nothing. So `generate` and `profile` check
every variable here first, on every rank, and end the job with exit 2 naming the variable and
the values it takes, before any compute. An empty value counts as unset everywhere.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from rworker.host.faults import HOWS as FAULT_HOWS
from rworker.protocol.control import KIND_NAMES

FAULT_POINTS = tuple(sorted({name.lower() for name in KIND_NAMES.values()} | {"step", "rewrite", "prefill-stream"}))


def one_of(*values: str, fold: bool = False) -> Callable[[str], str | None]:
    """A value from a fixed list (fold: compared stripped and lower-cased, as its reader does)."""
    def check(value: str) -> str | None:
        v = value.strip().lower() if fold else value
        return None if v in values else f"expected one of {', '.join(values)}"
    return check


def integer(least: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        try:
            ok = int(value) >= least
        except ValueError:
            ok = False
        return None if ok else f"expected an integer >= {least}"
    return check


def isa_name(value: str) -> str | None:
    from rworker.isa import EMULATED, ISAS
    return one_of(*ISAS, *EMULATED, fold=True)(value)


def fault_spec(value: str) -> str | None:
    parts = value.split(":")
    ok = len(parts) in (2, 3, 4) and parts[0].isdigit() and parts[1] in FAULT_POINTS and \
        (len(parts) == 2 or parts[2] in FAULT_HOWS or (parts[2] == "" and len(parts) == 4)) and \
        (len(parts) < 4 or (parts[3].isdigit() and int(parts[3]) > 0))
    return None if ok else (f"expected <rank>:<point>[:<how>[:<nth>]] with point one of {', '.join(FAULT_POINTS)}, "
                            f"how one of {', '.join(FAULT_HOWS)} and nth a positive count")


ON_OFF = one_of("0", "1")
# name -> check of a non-empty value (None: accepted). FASTDECODE_CACHE (a directory) and
# FASTDECODE_SUPERVISED (set by the supervisor) take any value.
CHECKS: dict[str, Callable[[str], str | None]] = {
    "FASTDECODE_ISA": isa_name,
    "FASTDECODE_KERNEL_TUNE": one_of("0", "1", fold=True),
    "FASTDECODE_VTILE": one_of("0", "16", "32", "-2", fold=True),     # the V layouts of the kernel builds
    "FASTDECODE_PREFETCH": one_of("0", "off", "1", "on", "scattered"),
    "FASTDECODE_AMX": one_of("0", "off", "1", "on", "emulate", fold=True),
    "FASTDECODE_DPBF16": ON_OFF,
    "FASTDECODE_PROMPT_KERNEL": ON_OFF,
    "FASTDECODE_PACKED": ON_OFF,
    "FASTDECODE_THREADS": integer(1),
    "FASTDECODE_PIN": ON_OFF,
    "FASTDECODE_SPIN_US": integer(0),
    "FASTDECODE_WAIT": one_of("adaptive", "spin", "sleep"),
    "FASTDECODE_PROGRESS_THREAD": ON_OFF,
    "FASTDECODE_SHM_LINK": ON_OFF,
    "FASTDECODE_EXTENT_PAGES": integer(1),
    "FASTDECODE_RESERVE_PAGES": ON_OFF,
    "FASTDECODE_FUSED": one_of("auto", "0", "1"),
    "FASTDECODE_PAGED_ATTN": one_of("auto", "torch", "triton", fold=True),
    "FASTDECODE_DEVICE_TIER": one_of("torch", fold=True),
    "FASTDECODE_NO_SUPERVISOR": ON_OFF,
    "FASTDECODE_INJECT_FAULT": fault_spec,
}


def environment_errors(runs_kernels: bool, environ: dict | None = None) -> list[str]:
    """One message per bad FASTDECODE_* value, naming the variable and what it takes. runs_kernels:
    this process runs the attention kernels (an R-worker, or local mode), so a forced ISA must be
    one its CPU has."""
    env = os.environ if environ is None else environ
    errors = []
    for name, check in CHECKS.items():
        value = env.get(name, "")
        if not value:
            continue
        why = check(value)
        if why:
            errors.append(f"{name}={value!r}: {why}")
    isa = env.get("FASTDECODE_ISA", "").strip().lower()
    if runs_kernels and isa and isa_name(isa) is None:
        from rworker.isa import available_isas, missing_features
        missing = missing_features(isa)
        if missing:
            errors.append(f"FASTDECODE_ISA={isa!r}: this CPU lacks {', '.join(missing)}; it runs "
                          f"{', '.join(available_isas())}")
    return errors


def environment_error(runs_kernels: bool) -> str | None:
    """All bad values in one line, or None."""
    errors = environment_errors(runs_kernels)
    return "; ".join(errors) if errors else None
