"""Stop requests on rank 0: SIGUSR1 (SLURM's warning before a time limit or preemption),
SIGTERM (scancel, preemption) and SIGINT (Ctrl-C) ask the batch to stop cleanly.

The handler only sets a flag; the decode loop looks at it between steps, so the step in flight
finishes, what is done is written, the R-workers are shut down and the job exits with
EX_TEMPFAIL (75), which the SLURM scripts requeue on. mpiexec (hydra) and srun forward these
signals to every rank; R-workers ignore them and wait for rank 0's shutdown.

The handlers go in as the process starts (`STOP`, installed by cli.main before MPI or torch
load, and again after MPI_Init, which may install its own), so a signal at any moment of a run,
model load included, is a clean stop: rank 0 then shuts the R-workers down and exits 75.

A further signal while stopping is only noted: the rows being written must not be cut short,
and under a launcher one signal often arrives twice (sent to the task and forwarded by the
script or the supervisor). SIGKILL remains for "now".
"""
from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def _say(text: str) -> None:
    # os.write, not print: a handler may run while the main thread is inside a print to stderr
    try:
        os.write(2, f"fastdecode: {text}\n".encode())
    except OSError:
        pass


class StopRequest:
    def __init__(self):
        self.signum: int | None = None
        self.repeats = 0                 # signals received after the first
        self._old: dict[int, object] = {}

    def install(self) -> StopRequest:
        """Take the stop signals (again: an MPI library may have taken them meanwhile); a
        signal already received stays recorded."""
        for sig in SIGNALS:
            old = signal.signal(sig, self._handle)
            self._old.setdefault(sig, old)
        return self

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            _say(f"got {name}: stopping after the step in flight, saving what is done")
        else:
            self.repeats += 1
            _say(f"got {name} while stopping: ignored, still saving (SIGKILL ends at once)")

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def release(self) -> None:
        """Give the signals back (a command with nothing to save); one already received is
        delivered again, now with its default action."""
        self.restore()
        if self.signum is not None:
            os.kill(os.getpid(), self.signum)


STOP = StopRequest()      # rank 0's, for the whole process
