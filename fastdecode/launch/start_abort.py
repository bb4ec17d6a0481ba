"""End a job whose rank died before MPI was up on every rank.

The other ranks then wait inside MPI_Init (C code: no Python timer runs there), and the
launchers do not end them: MPICH's hydra waits for a process that exits before it joined PMI
(measured: until the ranks' start-up watchdog, 300 s). The dead rank's supervisor still holds
its launcher connection (PMI_FD, the PMIx and srun variables), so it runs this module as the
rank in the dead one's place: MPI_Init joins the others, and MPI_Abort ends every rank at once.
"""
from __future__ import annotations

import os
import subprocess
import sys

ABORT_WAIT_S = 30.0      # MPI_Init waits for every rank: one still importing arrives within this


def end_ranks_waiting_in_mpi_init(code: int) -> bool:
    """In a supervisor whose child died before MPI was up: join MPI in its place and abort the job
    (which ends this process too, under most launchers). False if that did not happen in time, or
    was not needed: Open MPI's mpirun ends the job itself once a process exits non-zero."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return False
    print("fastdecode: a rank died before MPI was up on every rank: ending the others (MPI_Abort in its place)",
          file=sys.stderr, flush=True)
    try:
        helper = subprocess.run([sys.executable, "-m", "fastdecode.launch.start_abort", str(code)],
                                close_fds=False, timeout=ABORT_WAIT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return helper.returncode != 0


def main() -> int:
    code = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
