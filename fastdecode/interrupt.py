"""Stop requests on rank 0: SIGUSR1 (SLURM's warning before a time limit or preemption),
SIGTERM (scancel, preemption) and SIGINT (Ctrl-C) ask the batch to stop cleanly.

The handler only sets a flag; the decode loop looks at it between steps, so the step in flight
finishes, what is done is written, the R-workers are shut down and the job exits with
EX_TEMPFAIL (75), which the SLURM scripts requeue on. mpiexec (hydra) and srun forward these
signals to every rank; R-workers ignore them and wait for rank 0's shutdown.
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self, second_sigint_aborts: bool = False):
        # a second Ctrl-C in a terminal means "now"; under a launcher one Ctrl-C may arrive twice
        self.second_sigint_aborts = second_sigint_aborts
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def install(self) -> StopRequest:
        for sig in SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None and signum == signal.SIGINT and self.second_sigint_aborts:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum

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
