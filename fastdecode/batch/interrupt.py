"""Stop requests on rank 0: SIGUSR1 (SLURM's warning before a time limit or preemption),
SIGTERM (scancel, preemption), SIGINT (Ctrl-C) and SIGHUP (a hang-up) ask the batch to stop cleanly.

The handler only sets a flag; the decode loop looks at it between steps, so the step in flight
finishes, what is done is written, the generation still in flight is saved (inflight.py: the
rerun continues it), the R-workers are shut down and the job exits with EX_TEMPFAIL (75), which
the SLURM scripts requeue on. mpiexec (hydra) and srun forward these
signals to every rank; R-workers ignore them and wait for rank 0's shutdown.

The handlers go in as the process starts (`STOP`, installed by cli.main before MPI or torch
load, and again after MPI_Init, which may install its own), so a signal at any moment of a run,
model load included, is a clean stop: rank 0 then shuts the R-workers down and exits 75.

A further signal while stopping is only noted: the rows being written must not be cut short,
and under a launcher one signal often arrives twice (sent to the task and forwarded by the
script or the supervisor). SIGKILL remains for "now".

Some launchers give rank 0 little time: Open MPI's mpirun, signalled SIGTERM or SIGINT itself,
sends every rank SIGCONT, SIGTERM `odls_base_sigkill_timeout` seconds later (default 1) and SIGKILL
as long again after that (docs/usage.md, "Batch jobs"). So the first stop signal is also acted on at
once, off the main thread (`watch`): the run report says "interrupted" with the rows done so far
before the step in flight ends, even while the main thread waits inside C code (an MPI call, the
model load), where a Python handler cannot run. Python's signal wake-up fd carries the signal to a
thread the moment it arrives; the handler itself pokes that thread too, should anything else take
the wake-up fd.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable

# SIGHUP (a closed terminal, a hang-up of the session) is a stop like SIGTERM, not a death
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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
        self.noticed: int | None = None  # the first, as the watch thread saw it (maybe before the handler)
        self._old: dict[int, object] = {}
        self._poke: socket.socket | None = None

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
        poke = self._poke
        if poke is not None:
            try:
                poke.send(bytes([signum]))
            except OSError:
                pass

    @property
    def requested(self) -> bool:
        return self.signum is not None or self.noticed is not None

    @property
    def name(self) -> str | None:
        signum = self.signum if self.signum is not None else self.noticed
        return signal.Signals(signum).name if signum is not None else None

    def watch(self, on_first: Callable[[int], None]) -> None:
        """Main thread, once: call on_first(signum) on a thread of its own as the first stop signal
        arrives (at once if one came already). The process's signal wake-up fd is taken for it."""
        if self._poke is not None:
            return
        read_end, write_end = socket.socketpair()
        write_end.setblocking(False)
        try:
            signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
        except ValueError:               # not the main thread: the handler's poke still wakes it
            pass
        self._poke, self._read_end = write_end, read_end       # both kept open for the process's life
        threading.Thread(target=self._watch, args=(read_end, on_first), name="stop-watch", daemon=True).start()
        if self.signum is not None:
            write_end.send(bytes([self.signum]))

    def _watch(self, read_end: socket.socket, on_first: Callable[[int], None]) -> None:
        stops = {int(s) for s in SIGNALS}
        while True:
            try:
                data = read_end.recv(64)
            except OSError:
                return
            if not data:
                return
            signum = next((b for b in data if b in stops), None)
            if signum is None:
                continue
            if self.noticed is None:
                self.noticed = signum
            try:
                on_first(self.noticed)
            except Exception as e:  # noqa: BLE001 - the main thread still saves at the end of its step
                _say(f"could not note the stop in the run report at once: {type(e).__name__}: {e}")
            return

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
