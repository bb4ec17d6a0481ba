"""Thread count and pinning for the R-worker kernels.

The attention kernel is memory-bound: one thread per physical core saturates a socket's memory
bandwidth, a second hyperthread on the same core adds little and competes for its L1/L2. So the
default is one thread per physical core of the CPUs this process may run on (its affinity set,
which mpirun/srun/numactl narrow per rank), each pinned to one logical CPU of a different core.
"""
from __future__ import annotations

import os

_SYSFS = "/sys/devices/system/cpu/cpu{}/topology/{}"


def cpu_set() -> list[int]:
    """Logical CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _read(cpu: int, name: str) -> str | None:
    try:
        with open(_SYSFS.format(cpu, name)) as f:
            return f.read().strip()
    except OSError:
        return None


def physical_cpus(cpus: list[int] | None = None) -> list[int]:
    """One logical CPU per physical core among `cpus` (first sibling of each core), in order."""
    cpus = cpu_set() if cpus is None else list(cpus)
    seen, out = set(), []
    for c in cpus:
        pkg, core = _read(c, "physical_package_id"), _read(c, "core_id")
        if pkg is None or core is None:  # no sysfs topology: estimate from psutil's core count
            return _physical_by_ratio(cpus)
        if (pkg, core) not in seen:
            seen.add((pkg, core))
            out.append(c)
    return out or cpus[:1]


def _physical_by_ratio(cpus: list[int]) -> list[int]:
    try:
        import psutil

        logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unable to tell
        return cpus
    if not logical or not physical or physical >= logical:
        return cpus
    per_core = logical // physical
    return cpus[::per_core] or cpus[:1]


def default_threads() -> int:
    """FASTDECODE_THREADS if set, else the number of physical cores in the affinity set."""
    env = os.environ.get("FASTDECODE_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"FASTDECODE_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"FASTDECODE_THREADS must be a positive integer, got {env!r}")
        return n
    return len(physical_cpus())


def pin_cpus(threads: int) -> list[int]:
    """CPUs for worker threads 0..threads-1 (physical cores first, then their siblings).

    Empty when FASTDECODE_PIN=0: threads then float freely."""
    if os.environ.get("FASTDECODE_PIN", "1") == "0":
        return []
    phys = physical_cpus()
    rest = [c for c in cpu_set() if c not in set(phys)]
    order = phys + rest
    return [order[i % len(order)] for i in range(max(threads, 1))]
