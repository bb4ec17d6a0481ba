"""What rank 0 writes as its run report if its supervisor dies (launch/supervise.py writes it then,
with plain system calls): the report of the run in progress marked failed, set here by the report
as it changes (batch/report.py), and a check that may name a rank found gone instead (set by the
MPI set-up, launch/mpi_env.py)."""
from __future__ import annotations

_note: tuple[str, bytes] | None = None     # (report path, report bytes)
_check = None                              # () -> report bytes naming a rank found gone, or None


def note_for_orphan(path: str | None, data: bytes | None) -> None:
    """Rank 0: the report to write at `path` if this process ends because its supervisor died
    (None: nothing, the run has ended)."""
    global _note
    _note = (path, data) if path is not None and data is not None else None


def on_orphan(check) -> None:
    """Rank 0: check() -> the report naming a rank found gone, to write instead of the prepared note."""
    global _check
    _check = check


def pending() -> tuple[tuple[str, bytes] | None, object]:
    """(the prepared note, the check) as they are now."""
    return _note, _check
