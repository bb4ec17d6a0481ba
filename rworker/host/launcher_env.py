"""This process's rank and the job's size as the MPI launcher's environment tells them, before MPI
starts (and without it: 0 and 1). Both sides ask: fastdecode's roles (launch/ranks.py), and an
R-worker naming itself by its world rank where its communicator is a data-parallel group's."""
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


def world_rank_or(rank: int) -> int:
    """The launcher's rank of this process where a launcher started it, else `rank` (a rank of a
    communicator, in-process tests)."""
    if any(var in os.environ for var in RANK_VARS) or int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        return launched_rank()
    return rank
