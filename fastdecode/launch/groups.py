"""Data-parallel groups on MPI (`--data-parallel-size D`): each rank's group communicator (an
S-worker and its R-workers, no collective ever spanning two groups), the communicator of the
groups' S-workers (the dealer's, batch/dealer.py), and the node's CPUs shared out between groups
that share a node where no launcher bound the ranks already."""
from __future__ import annotations

import os
from dataclasses import dataclass

from fastdecode.launch.ranks import Roles, set_group


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
    set_group(g)
    comm = world.Split(g, rank)
    is_leader = rank in roles.leaders()
    leaders = world.Split(0 if is_leader else MPI.UNDEFINED, rank)
    share_node(world, g, rank < roles.groups * roles.s_ranks, roles.s_ranks)
    return Group(g, comm if comm.Get_size() > 1 else None, leaders if is_leader else None)


def share_node(world, group: int, s_rank: bool, s_ranks: int) -> None:
    """Collective over world: where ranks of several groups share a node, each group keeps its
    share of it. Its CPUs: an equal contiguous share each, where nothing bound the ranks, so that
    two groups' S-parts and kernels never run on the same cores (each sizes its threads to its
    share). Its GPUs: the S-ranks of the n-th group with S-ranks here see the n-th `s_ranks` of the
    node's GPUs (CUDA_VISIBLE_DEVICES, set before torch starts CUDA), so two groups' S-workers
    never take the same card."""
    from mpi4py import MPI

    from rworker.host.cores import launcher_bound
    from rworker.host.threads import cpu_set
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        seen = node.allgather((group, s_rank))
        bound = node.allreduce(1 if launcher_bound() else 0)
    finally:
        node.Free()
    here = sorted({g for g, _ in seen})
    heads = sorted({g for g, s in seen if s})
    if s_rank and len(heads) > 1:
        visible = visible_gpus()
        if visible:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_share(visible, heads.index(group), s_ranks))
    if len(here) < 2 or bound or not hasattr(os, "sched_setaffinity"):
        return
    os.sched_setaffinity(0, cpu_share(cpu_set(), here.index(group), len(here)))


def cpu_share(cpus: list[int], at: int, count: int) -> list[int]:
    """The `at`-th of `count` contiguous shares of `cpus` (the last takes the remainder)."""
    share = max(len(cpus) // count, 1)
    mine = cpus[at * share:(at + 1) * share] if at < count - 1 else cpus[at * share:]
    return mine or cpus[-1:]


def gpu_share(visible: list[str], at: int, per_group: int) -> list[str]:
    """The GPUs of the `at`-th group on a node, `per_group` each; past the node's GPUs a group
    shares the last ones (the engine's start-up then says which card it took)."""
    mine = visible[at * per_group:(at + 1) * per_group]
    return mine or visible[-per_group:]


def visible_gpus() -> list[str]:
    """The node's GPUs as CUDA would number them for this process, without starting CUDA:
    CUDA_VISIBLE_DEVICES where set, else the NVIDIA driver's list; [] where there is none."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d for d in given.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def group_error(groups: int, s_ranks: int, world: int) -> str | None:
    """Why `world` ranks cannot form `groups` groups of S-workers of `s_ranks` ranks (None: they can)."""
    if groups == 1 or world >= groups * s_ranks:
        return None
    need = groups * s_ranks
    return (f"--data-parallel-size {groups} needs at least {need} MPI ranks ({groups} S-worker"
            f"{'s' if groups > 1 else ''} of {s_ranks} rank{'s' if s_ranks > 1 else ''}: mpirun -n {need}; ranks "
            f"beyond them become the groups' R-workers), this job has {world}")
