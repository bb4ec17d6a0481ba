"""MPI roles and failure handling: rank 0 is the S-worker, ranks 1..R are R-workers.

An uncaught exception on any rank must end the whole job (COMM_WORLD.Abort) with a message
naming the rank, never leave the others waiting forever.
"""
from __future__ import annotations

import os
import socket
import sys

_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_rank() -> int:
    """This process's rank as the launcher's environment tells it, before MPI starts (0 if none)."""
    for var in _RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])
    return 0


def launched_size() -> int:
    for var in _SIZE_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))


def world():
    """COMM_WORLD, or None when this process runs alone without an MPI launcher or without mpi4py."""
    if launched_size() <= 1:
        try:
            from mpi4py import MPI
        except ImportError:
            return None
        return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None
    from mpi4py import MPI
    return MPI.COMM_WORLD


def role_name(rank: int) -> str:
    return "S-worker" if rank == 0 else "R-worker"


EXIT_TEMPFAIL = 75        # EX_TEMPFAIL: outputs saved, rerun me (the SLURM scripts requeue on it)


def fail(comm, exc: BaseException, code: int = 1) -> None:
    """Print one line naming this rank and end the whole job. A silent peer (a stuck or lost
    node) ends it with EX_TEMPFAIL so that a batch system requeues it; outputs are on disk."""
    from rworker.host.wait import PeerTimeout
    if isinstance(exc, PeerTimeout):
        code = EXIT_TEMPFAIL
    rank = comm.Get_rank() if comm is not None else 0
    where = f"rank {rank} ({role_name(rank)} on {socket.gethostname()})" if comm is not None else "fastdecode"
    print(f"fastdecode: {where} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    if comm is not None and comm.Get_size() > 1:
        from rworker.host.wait import abort_job
        abort_job(comm, code)
    sys.exit(code)
