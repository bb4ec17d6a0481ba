"""Which rank this process is, from the launcher's environment alone (before MPI starts), and
its role, decided here and nowhere else (Roles): rank 0 is the S-worker, ranks 1..R are
R-workers; with a tensor-parallel S-worker of T ranks (`--tensor-parallel-size T`, set here once
the command line or LLM(...) is read) ranks 1..T-1 are its other ranks and the R-workers are
ranks T..T+R-1. A job of T ranks or fewer has no R-workers: rank 0 holds the KV-cache itself
(local mode).

With `--data-parallel-size D` the job is D groups, each an S-worker with its own R-workers: the
S-workers come first (group g's are ranks g*T..g*T+T-1: a hetjob's GPU component, or the GPU
nodes first in a host file), then the R-workers in D contiguous blocks (block g is group g's;
sizes differ by one at most, the larger first). Inside a group its ranks are numbered as a job
of their own (S-ranks first). Group 0's S-worker (rank 0) also reads the input and writes the
output for all.
Imports nothing of fastdecode, so the supervisor, the MPI set-up and the reports can all ask."""
from __future__ import annotations

from dataclasses import dataclass

from rworker.host.launcher_env import RANK_VARS, SIZE_VARS, launched_rank, launched_size

__all__ = ["RANK_VARS", "SIZE_VARS", "Roles", "launched_rank", "launched_roles", "launched_size", "role_name",
           "set_group", "set_groups", "set_s_ranks", "world_rank"]


_s_ranks = 1              # the S-worker's ranks (0..T-1): --tensor-parallel-size, once parsed
_groups = 1               # --data-parallel-size, once parsed


def set_s_ranks(count: int) -> None:
    global _s_ranks
    _s_ranks = max(int(count), 1)


_group = 0                # this rank's group, once the groups are split (launch/groups.py)


def set_groups(count: int) -> None:
    global _groups
    _groups = max(int(count), 1)


def set_group(group: int) -> None:
    global _group
    _group = group


def world_rank(local: int) -> int:
    """The world rank of rank `local` of this rank's group (the same rank with one group)."""
    return launched_roles().group_ranks(_group)[local] if _groups > 1 else local


@dataclass(frozen=True)
class Roles:
    """The ranks of a job of `world` ranks in `groups` data-parallel groups, each S-worker of
    `s_ranks` ranks. Methods take world ranks."""
    world: int
    s_ranks: int = 1
    groups: int = 1

    def group_ranks(self, group: int) -> list[int]:
        """The world ranks of a group, in its own order: its S-ranks, then its block of R-workers."""
        heads = self.groups * self.s_ranks
        size, extra = divmod(max(self.world - heads, 0), self.groups)
        start = heads + group * size + min(group, extra)
        return [*range(group * self.s_ranks, (group + 1) * self.s_ranks),
                *range(start, start + size + (group < extra))]

    def group_of(self, rank: int) -> int:
        return next(g for g in range(self.groups) if rank in self.group_ranks(g))

    def local(self, rank: int) -> tuple[Roles, int]:
        """(the roles inside this rank's group, as a job of its own; the rank's place in it)."""
        ranks = self.group_ranks(self.group_of(rank))
        return Roles(len(ranks), self.s_ranks), ranks.index(rank)

    def leaders(self) -> list[int]:
        """Each group's S-worker (its first rank), by group."""
        return [g * self.s_ranks for g in range(self.groups)]

    def describe_groups(self) -> str:
        """The groups' ranks in one line (the start-up line of a job of several groups)."""
        parts = []
        for g in range(self.groups):
            ranks = self.group_ranks(g)
            rworkers = ranks[self.s_ranks:]
            s = f"S-worker rank{'s' if self.s_ranks > 1 else ''} {', '.join(map(str, ranks[:self.s_ranks]))}"
            r = f"R-workers {', '.join(map(str, rworkers))}" if rworkers else "no R-workers (local mode)"
            parts.append(f"group {g}: {s}, {r}")
        return "; ".join(parts)

    def name(self, rank: int) -> str:
        if self.groups > 1:
            inner, at = self.local(rank)
            return f"{inner.name(at)} of group {self.group_of(rank)}"
        if rank == 0:
            return "S-worker"
        return "tensor-parallel S-rank" if rank < self.s_ranks else "R-worker"

    def is_rworker(self, rank: int) -> bool:
        if self.groups > 1:
            inner, at = self.local(rank)
            return inner.is_rworker(at)
        return rank >= self.s_ranks

    def holds_kv(self, rank: int) -> bool:
        """An R-worker, or an S-worker in local mode (it then runs the attention kernels itself)."""
        if self.groups > 1:
            inner, at = self.local(rank)
            return inner.holds_kv(at)
        return self.is_rworker(rank) or (rank == 0 and self.world <= self.s_ranks)

    @property
    def rworkers(self) -> list[int]:
        """Group 0's R-workers (the job's, with one group)."""
        return self.group_ranks(0)[self.s_ranks:]

    @property
    def members(self) -> int:
        """The S-worker (as one, however many ranks) and its R-workers."""
        return len(self.rworkers) + 1

    @property
    def kv_holders(self) -> int:
        """The R-workers, or 1 in local mode (rank 0's own store)."""
        return max(len(self.rworkers), 1)


def launched_roles(s_ranks: int | None = None, groups: int | None = None) -> Roles:
    """This job's roles from the launcher's size, the S-worker's ranks and the groups (set_s_ranks's
    and set_groups's, unless given)."""
    return Roles(launched_size(), _s_ranks if s_ranks is None else max(int(s_ranks), 1),
                 _groups if groups is None else max(int(groups), 1))


def role_name(rank: int) -> str:
    return launched_roles().name(rank)
