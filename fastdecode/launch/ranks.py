"""Which rank this process is, from the launcher's environment alone (before MPI starts), and
its role: rank 0 is the S-worker, ranks 1..R are R-workers; with a tensor-parallel S-worker of T
ranks (`--tensor-parallel-size T`, set here once the command line is read) ranks 1..T-1 are its
other ranks and the R-workers are ranks T..T+R-1. Imports nothing of fastdecode, so the
supervisor, the MPI set-up and the reports can all ask."""
from __future__ import annotations

import os

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


def s_ranks() -> int:
    return _s_ranks


def role_name(rank: int) -> str:
    if rank == 0:
        return "S-worker"
    return "tensor-parallel S-rank" if rank < _s_ranks else "R-worker"
