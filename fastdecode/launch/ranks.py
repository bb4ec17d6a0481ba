"""Which rank this process is, from the launcher's environment alone (before MPI starts), and
its role, decided here and nowhere else (Roles): rank 0 is the S-worker, ranks 1..R are
R-workers; with a tensor-parallel S-worker of T ranks (`--tensor-parallel-size T`, set here once
the command line or LLM(...) is read) ranks 1..T-1 are its other ranks and the R-workers are
ranks T..T+R-1. A job of T ranks or fewer has no R-workers: rank 0 holds the KV-cache itself
(local mode). Imports nothing of fastdecode, so the supervisor, the MPI set-up and the reports
can all ask."""
from __future__ import annotations

import os
from dataclasses import dataclass

RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_rank() -> int:
    """This process's rank as the launcher's environment tells it, before MPI starts (0 if none)."""
    for var in RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    return 0


def launched_size() -> int:
    for var in SIZE_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))


_s_ranks = 1              # the S-worker's ranks (0..T-1): --tensor-parallel-size, once parsed


def set_s_ranks(count: int) -> None:
    global _s_ranks
    _s_ranks = max(int(count), 1)


@dataclass(frozen=True)
class Roles:
    """The ranks of a job of `world` ranks whose S-worker has `s_ranks` of them."""
    world: int
    s_ranks: int = 1

    def name(self, rank: int) -> str:
        if rank == 0:
            return "S-worker"
        return "tensor-parallel S-rank" if rank < self.s_ranks else "R-worker"

    def is_rworker(self, rank: int) -> bool:
        return rank >= self.s_ranks

    def holds_kv(self, rank: int) -> bool:
        """An R-worker, or rank 0 in local mode (it then runs the attention kernels itself)."""
        return self.is_rworker(rank) or (rank == 0 and self.world <= self.s_ranks)

    @property
    def rworkers(self) -> range:
        return range(self.s_ranks, max(self.world, self.s_ranks))

    @property
    def members(self) -> int:
        """The S-worker (as one, however many ranks) and its R-workers."""
        return len(self.rworkers) + 1

    @property
    def kv_holders(self) -> int:
        """The R-workers, or 1 in local mode (rank 0's own store)."""
        return max(len(self.rworkers), 1)


def launched_roles(s_ranks: int | None = None) -> Roles:
    """This job's roles from the launcher's size and the S-worker's ranks (set_s_ranks's, unless given)."""
    return Roles(launched_size(), _s_ranks if s_ranks is None else max(int(s_ranks), 1))


def role_name(rank: int) -> str:
    return launched_roles().name(rank)
