"""Data-parallel groups on MPI (`--data-parallel-size D`): each rank's group communicator (an
S-worker and its R-workers, no collective ever spanning two groups), the communicator of the
groups' S-workers (the dealer's, batch/dealer.py), and the node's CPUs shared out between groups
that share a node where no launcher bound the ranks already."""
from __future__ import annotations

import os
from dataclasses import dataclass

from fastdecode.launch.ranks import Roles


@dataclass
class Group:
    index: int                 # which group this rank is in
    comm: object               # the group's communicator (an MPI.Comm; None: a group of one rank)
    leaders: object            # the groups' S-workers' communicator on an S-worker (rank g = group g), else None


def split(world, roles: Roles) -> Group:
    """Collective over world: this rank's group. With one group the world is the group's."""
    from mpi4py import MPI
    rank = world.Get_rank()
    if roles.groups == 1:
        return Group(0, world, None)
    g = roles.group_of(rank)
    comm = world.Split(g, rank)
    is_leader = rank in roles.leaders()
    leaders = world.Split(0 if is_leader else MPI.UNDEFINED, rank)
    share_cpus(world, g)
    return Group(g, comm if comm.Get_size() > 1 else None, leaders if is_leader else None)


def share_cpus(world, group: int) -> None:
    """Collective over world: where ranks of several groups share a node and nothing bound them,
    each group's ranks keep an equal contiguous share of the node's CPUs, so that two groups'
    S-parts and kernels never run on the same cores (each then sizes its threads to its share)."""
    from mpi4py import MPI

    from rworker.host.cores import launcher_bound
    from rworker.host.threads import cpu_set
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        here = sorted(set(node.allgather(group)))
        bound = node.allreduce(1 if launcher_bound() else 0)
    finally:
        node.Free()
    if len(here) < 2 or bound or not hasattr(os, "sched_setaffinity"):
        return
    cpus = cpu_set()
    share = max(len(cpus) // len(here), 1)
    at = here.index(group)
    mine = cpus[at * share:(at + 1) * share] if at < len(here) - 1 else cpus[at * share:]
    os.sched_setaffinity(0, mine or cpus[-1:])


def group_error(groups: int, s_ranks: int, world: int) -> str | None:
    """Why `world` ranks cannot form `groups` groups of S-workers of `s_ranks` ranks (None: they can)."""
    if groups == 1 or world >= groups * s_ranks:
        return None
    need = groups * s_ranks
    return (f"--data-parallel-size {groups} needs at least {need} MPI ranks ({groups} S-worker"
            f"{'s' if groups > 1 else ''} of {s_ranks} rank{'s' if s_ranks > 1 else ''}: mpirun -n {need}; ranks "
            f"beyond them become the groups' R-workers), this job has {world}")
