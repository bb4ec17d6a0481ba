"""Which cores each rank of a node uses, when the launcher did not bind the ranks itself.

srun --cpu-bind / mpirun --bind-to / numactl give each rank its own CPU set: then a rank uses
exactly that. Otherwise every rank sees the whole node, and S-worker and R-workers would pile
their threads onto the same cores. Then the node's physical cores are split: the S-worker
keeps the first `s_cores` (what it computes with while the R-workers attend: half the node for
a CPU S-worker with a pipeline, one core for a CUDA S-worker, none when S and R take turns),
and the R-workers on the node share the rest evenly, each bound to a disjoint slice (its
memory then comes from the slice's NUMA node by first touch).
"""
from __future__ import annotations

import os

from rworker.host.threads import cpu_set, physical_cpus


def launcher_bound() -> bool:
    """True if this process's CPU set is narrower than the machine (someone bound it)."""
    return len(cpu_set()) < (os.cpu_count() or 1)


def s_worker_cores(cpu_s_worker: bool, pipelined: bool, rworkers_here: int) -> int:
    """Physical cores the S-worker computes with while R-workers on its node work."""
    cores = len(physical_cpus())
    if rworkers_here == 0:
        return cores
    if not cpu_s_worker:
        return 1                     # a CUDA S-worker's host thread (plus its MPI progress thread)
    return max(1, cores // 2) if pipelined else cores


def rworker_cpus(r_index: int, rworkers_here: int, s_cores_here: int) -> list[int]:
    """The CPUs R-worker number `r_index` (0-based among this node's R-workers) should use."""
    if launcher_bound():
        return cpu_set()
    phys = physical_cpus()
    free = phys[s_cores_here:] if s_cores_here < len(phys) else phys
    share = max(1, len(free) // max(rworkers_here, 1))
    start = (r_index * share) % len(free)
    mine = free[start:start + share] or free[:1]
    siblings = [c for c in cpu_set() if c not in set(phys) and _core_of(c) in {_core_of(p) for p in mine}]
    return mine + siblings


def _core_of(cpu: int):
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f:
            core = f.read().strip()
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
            return f.read().strip(), core
    except OSError:
        return cpu


def bind(cpus: list[int]) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
