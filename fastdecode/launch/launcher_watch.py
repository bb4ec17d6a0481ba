"""Whether the launcher itself is still there, for rank 0's report when ranks vanish.

Ranks killed by the launcher after one of them died, and ranks killed because the launcher died
(MPICH's `mpiexec` does not catch SIGHUP or SIGUSR2: it dies, and its proxies end every rank), look
the same from rank 0: R-worker links close without a word. Only in the first case does the launcher
outlive the ranks (it waits for them, then exits with its own code: hydra 9); in the second it is
gone first, and its exit status (128 + the signal's number, from a shell) is its parent's to see.
So rank 0 notes, at start-up, the launcher's front end on its node (`mpiexec`, `mpirun`: the
process above the proxy or daemon that started its supervisor), and asks whether it still runs
when it writes such a report. Plain file reads only: the question is asked from a signal handler.
"""
from __future__ import annotations

import os
from typing import NamedTuple

FRONT_ENDS = ("mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpirun.mpich", "mpirun.openmpi", "orterun",
              "prterun")


class Launcher(NamedTuple):
    name: str
    pid: int
    start: str          # its start time in clock ticks (/proc/PID/stat field 22): a reused pid is another process


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time) of a process, from /proc; None if it is not there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()       # after the name, which may hold spaces
    try:
        return fields[0], int(fields[1]), fields[19]
    except (IndexError, ValueError):
        return None


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def find(levels: int = 4) -> Launcher | None:
    """The launcher's front end among this process's ancestors on this node (a supervised rank:
    child, supervisor, proxy or daemon, front end); None where there is none here (a remote node,
    srun, no launcher)."""
    pid = os.getppid()
    for _ in range(levels):
        stat = _stat(pid)
        if stat is None or pid <= 1:
            return None
        name = _name(pid)
        if name in FRONT_ENDS:
            return Launcher(name, pid, stat[2])
        pid = stat[1]
    return None


def gone(launcher: Launcher | None) -> bool:
    """Whether the launcher noted by find() has ended (exited, or a zombie its parent has not reaped)."""
    if launcher is None:
        return False
    stat = _stat(launcher.pid)
    return stat is None or stat[0] in ("Z", "X") or stat[2] != launcher.start


def died_text(launcher: Launcher) -> str:
    """The report's error for ranks ended because the launcher died."""
    return (f"the launcher ({launcher.name} pid {launcher.pid}) died before the job ended (killed, or a signal it "
            f"does not catch: SIGHUP or SIGUSR2 to MPICH's mpiexec) and every rank was ended with it; no rank "
            f"failed. Its exit status is its parent's to see (128 + the signal's number from a shell); the rows "
            f"written stay and a rerun resumes")
