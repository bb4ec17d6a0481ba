"""Which rank this process is, from the launcher's environment alone (before MPI starts), and
its role: rank 0 is the S-worker, ranks 1..R are R-workers. Imports nothing of fastdecode, so the
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


def role_name(rank: int) -> str:
    return "S-worker" if rank == 0 else "R-worker"
