"""Move MPI messages while this rank computes.

MPI moves a large (rendezvous) message only inside MPI calls of both ranks. A rank busy in a
kernel or a GEMM makes none, so a message posted before the compute would sit until after it,
and the S/R pipeline would serialize. A Progressor thread tests the outstanding requests while
the main thread computes (MPI_THREAD_MULTIPLE; the compute releases the GIL). It sleeps with
backoff when nothing is due, so an oversubscribed node loses little CPU to it.

Requests handed to the Progressor are its own: the main thread only waits on the returned
Ticket, never tests the requests itself.
"""
from __future__ import annotations

import os
import threading
import time

from mpi4py import MPI

from rworker.host.wait import PeerTimeout

MIN_SLEEP_S = 2e-5
MAX_SLEEP_S = 5e-4          # nobody waiting: the messages only need to keep moving
WAITED_SLEEP_S = 5e-5       # the main thread waits: answer fast


class Ticket:
    __slots__ = ("event", "requests", "names", "received")

    def __init__(self, requests: list[MPI.Request], names: list[str], sizes: bool = False):
        self.event = threading.Event()
        self.requests = requests
        self.names = names                  # who answers each request (for timeout messages)
        # receives: bytes each one got (filled as they complete), so a short message is seen
        self.received: list[int] | None = [-1] * len(requests) if sizes else None

    def note(self, indices, statuses: list[MPI.Status]) -> None:
        """Record the sizes of the requests completed at `indices` (statuses in the same order)."""
        if self.received is not None:
            for k, i in enumerate(indices):
                self.received[i] = statuses[k].Get_count(MPI.BYTE)

    def silent(self) -> str:
        """The peers whose requests are still open."""
        if self.requests is None:
            return "the local device copy"
        open_ = [n for r, n in zip(self.requests, self.names) if r != MPI.REQUEST_NULL]
        return ", ".join(dict.fromkeys(open_)) or ", ".join(dict.fromkeys(self.names))


def _describe(err: MPI.Exception, ticket: Ticket, statuses: list[MPI.Status] | None) -> str:
    """An MPI error of a request, with the peer it came from (a message longer than its buffer:
    "Message truncated")."""
    for st, name in zip(statuses or [], ticket.names):
        if st.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING):
            return f"a message from {name}: {MPI.Get_error_string(st.Get_error()).splitlines()[0]}"
    return f"{ticket.silent()}: {str(err).splitlines()[0]}"


class Progressor:
    def __init__(self, spin_s: float = 0.0):
        # FASTDECODE_PROGRESS_THREAD=0: no thread; requests then move only when this rank waits
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE and \
            os.environ.get("FASTDECODE_PROGRESS_THREAD", "1") != "0"
        self.spin_s = spin_s
        self._pending: list[Ticket] = []
        self._deferred: list = []               # (ready, post, ticket) waiting for a device copy
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._waiters = 0
        self._error: BaseException | None = None
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="mpi-progress", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ main-thread side

    def track(self, requests: list[MPI.Request], who: str | list[str] = "peer", sizes: bool = False) -> Ticket:
        """Hand requests to the thread; `who` names the peer of each (or of all) for errors;
        `sizes`: record how many bytes each receive got (Ticket.received)."""
        names = who if isinstance(who, list) else [who] * len(requests)
        pairs = [(r, n) for r, n in zip(requests, names) if r is not None]
        ticket = Ticket([r for r, _ in pairs], [n for _, n in pairs], sizes)
        if not ticket.requests:
            ticket.event.set()
            return ticket
        if not self.threaded:
            return ticket
        with self._lock:
            self._pending.append(ticket)
        self._wake.set()
        return ticket

    def track_after(self, ready, post, who: list[str]) -> Ticket:
        """Call post() -> requests once ready() is true (a device copy has landed), off this thread.

        The S-worker on a GPU queues the next mini-batch's kernels instead of blocking until the
        previous one's rows reached host memory; this thread then sends them."""
        if not self.threaded or ready():
            return self.track(post(), who)
        ticket = Ticket([], who)
        ticket.requests = None                 # filled in by the thread
        with self._lock:
            self._deferred.append((ready, post, ticket))
        self._wake.set()
        return ticket

    def wait(self, ticket: Ticket, timeout: float | None = None, patient: bool = False) -> None:
        """Block until the ticket's requests are done. patient: a wait whose answer is not urgent
        (an R-worker's prefill K/V while the S-worker computes the next layer): the thread keeps
        polling at its idle pace, which leaves the cores to co-located compute."""
        if ticket.event.is_set():
            return
        if not self.threaded:
            from rworker.host.wait import wait_all
            statuses = [MPI.Status() for _ in ticket.requests]
            wait_all(ticket.requests, "adaptive", timeout, ticket.silent(), statuses)
            ticket.note(range(len(statuses)), statuses)
            ticket.event.set()
            return
        start = time.perf_counter()
        if patient:
            self._wait_event(ticket, timeout, start)
            return
        self._waiters += 1
        self._wake.set()
        try:
            self._wait_event(ticket, timeout, start)
        finally:
            self._waiters -= 1

    def _wait_event(self, ticket: Ticket, timeout: float | None, start: float) -> None:
        while not ticket.event.wait(0.05 if timeout is None else min(0.05, timeout)):
            if self._error is not None:
                raise RuntimeError(f"MPI progress thread failed: {self._error}") from self._error
            if timeout is not None and time.perf_counter() - start > timeout:
                raise PeerTimeout(f"no reply from {ticket.silent()} within {timeout:.0f} s")

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self.threaded:
            self._thread.join(timeout=1.0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        sleep = MIN_SLEEP_S
        try:
            while not self._stop:
                with self._lock:
                    deferred = [d for d in self._deferred if d[0]()]
                    for d in deferred:
                        self._deferred.remove(d)
                for _, post, t in deferred:
                    t.requests = [r for r in post() if r is not None]
                    with self._lock:
                        self._pending.append(t)
                with self._lock:
                    tickets = list(self._pending)
                    waiting_on_device = bool(self._deferred)
                if not tickets and not waiting_on_device:
                    self._wake.wait(0.01)
                    self._wake.clear()
                    sleep = MIN_SLEEP_S
                    continue
                progressed = False
                for t in tickets:
                    statuses = [MPI.Status() for _ in t.requests] if t.received is not None else None
                    try:
                        done = MPI.Request.Testsome(t.requests, statuses)   # completed ones become REQUEST_NULL
                    except MPI.Exception as e:
                        raise RuntimeError(_describe(e, t, statuses)) from None
                    if done and statuses is not None:
                        t.note(done, statuses)
                    if all(r == MPI.REQUEST_NULL for r in t.requests):
                        with self._lock:
                            self._pending.remove(t)
                        t.event.set()
                        progressed = True
                if progressed:
                    sleep = MIN_SLEEP_S
                else:
                    if self._wake.wait(sleep):     # new requests: look at them at once
                        self._wake.clear()
                        sleep = MIN_SLEEP_S
                    else:
                        sleep = min(sleep * 2, WAITED_SLEEP_S if self._waiters else MAX_SLEEP_S)
        except BaseException as e:  # noqa: BLE001 - reported to the main thread by wait()
            self._error = e
