"""Data-parallel groups, the dealer's side (group 0's S-worker, world rank 0): the job's one
reader and one writer. The other groups' S-workers ask for lines when their queues run low
(`want`); every deal, group 0's own queue included, is capped at the group's fair share of the
work left (share), so the input's end is shared out and a slow group never holds the job's end
beyond its share. The dealer claims each line in the resume index as it deals it, writes every
group's rows into the one output, and relays a stop to every group, whose generation in flight
comes back for the one in-flight save.

Messages go over `leaders`, a communicator of the groups' S-workers only (group g is its rank g),
as pickled tuples on TAG_DEAL (group_link.py). The dealer reads them between its own steps: a
group's rows wait at most one step of group 0.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from fastdecode.batch.group_link import TAG_DEAL, GroupStatus, Outbox
from rworker.host.wait import PeerTimeout


@dataclass
class GroupState:
    """What the dealer knows of one remote group."""
    want: int = 0                    # lines it asked for and has not been sent
    status: GroupStatus = field(default_factory=GroupStatus)
    finished: bool = False           # its last message came: done, or stopped
    summary: dict | None = None
    last_heard: float = field(default_factory=time.monotonic)


class Dealer:
    """Deals lines to groups 1..D-1 and writes their rows through a BatchRunner (serve.py)."""

    def __init__(self, leaders, timeout: float | None = None):
        from mpi4py import MPI
        self.comm, self.MPI = leaders, MPI
        self.groups = {g: GroupState() for g in range(1, leaders.Get_size())}
        self.timeout = timeout or 900.0
        self.in_flight: dict = {}            # a stopped group's generation in flight, by line key
        self.outbox = Outbox(leaders)

    # ------------------------------------------------------------------------ start

    def start(self, serve: bool) -> None:
        """Tell every group to load its engine (serve) or to end its R-workers (nothing to serve)."""
        for g in self.groups:
            self.outbox.send(("start" if serve else "skip",), g)
        self.outbox.flush()
        if not serve:
            for state in self.groups.values():
                state.finished = True

    # ------------------------------------------------------------------------ between steps

    def poll(self, runner) -> None:
        """Take every message that has arrived, then answer the groups' wants from the input."""
        status = self.MPI.Status()
        while self.comm.Iprobe(self.MPI.ANY_SOURCE, TAG_DEAL, status):
            g = status.Get_source()
            self._handle(runner, g, self.comm.recv(source=g, tag=TAG_DEAL))
        for g, state in self.groups.items():
            if state.want > 0 and not state.finished:
                self._deal(runner, g, state)
        self.outbox.test()

    def _handle(self, runner, g: int, msg: tuple) -> None:
        state = self.groups[g]
        state.last_heard = time.monotonic()
        kind = msg[0]
        if kind == "want":
            state.want, state.status = msg[1], msg[2]
        elif kind == "rows":
            self._take_rows(runner, msg[1], msg[2])
            state.status = msg[3]
        elif kind in ("done", "stopped"):
            self._take_rows(runner, msg[1], msg[2])
            state.summary, state.finished, state.want = msg[3], True, 0
            state.status = GroupStatus(output_tokens=msg[3].get("output_tokens", 0),
                                       expected_tokens=msg[3].get("output_tokens", 0))
            if kind == "stopped":
                self.in_flight.update(msg[4])
        else:
            raise RuntimeError(f"group {g} sent an unknown message {kind!r}")

    def _take_rows(self, runner, rows: list, notes: list) -> None:
        saved = runner.saved
        for states, refused, line_no in notes:
            if saved is not None:
                saved.note_used(states, refused, line_no)
        for line_no, obj, code, key in rows:
            runner._write(line_no, obj, code, key)
            if code is None:
                runner.num_requests += 1
            else:
                runner.errors[code] += 1
        if rows:
            runner.writer.sync()

    def share(self, runner, group: int) -> int | None:
        """Lines group `group` may take now: its fair share of the work left (the input's unread
        lines and every group's queued and running ones, split evenly) less what it holds. So a
        small input is split evenly, however early a group asks, and the input's end is shared out;
        on a large one the groups' own asks (free slots and a few more) are the bound. None: no
        bound known (an input of unknown length)."""
        if runner.total_lines is None:
            return None
        unread = max(runner.total_lines - runner.lines_read, 0)
        sched = runner.engine.scheduler
        held = {0: len(sched.running) + len(sched.waiting)}
        held.update({g: s.status.running + s.status.waiting for g, s in self.groups.items() if not s.finished})
        fair = -(-(unread + sum(held.values())) // len(held))
        return max(fair - held.get(group, 0), 0)

    def _deal(self, runner, g: int, state: GroupState) -> None:
        lines = []
        share = self.share(runner, g)
        want = state.want if share is None else min(state.want, max(share, 1))
        while len(lines) < want and not runner.exhausted:
            line = runner._next_line()
            if line is None:
                break
            claimed = runner._claim(line)
            if claimed is not None:
                lines.append((line, *claimed))
        if lines or runner.exhausted:
            self.outbox.send(("lines", lines, runner.exhausted), g)
            state.want = 0
            # held there from now on (its next message says so too): the shares that follow count them
            state.status = dataclasses.replace(state.status, waiting=state.status.waiting + len(lines))

    # ------------------------------------------------------------------------ waiting and the end

    @property
    def finished(self) -> bool:
        return all(state.finished for state in self.groups.values())

    def status(self) -> GroupStatus:
        """The remote groups' progress, summed."""
        total = GroupStatus()
        for state in self.groups.values():
            total = total + state.status
        return total

    def wait(self, runner, stopping=lambda: False) -> None:
        """Group 0 has nothing to run: block (politely) until a group's message arrives or a stop
        is requested; a group silent for the timeout ends the job naming it."""
        status = self.MPI.Status()
        delay = 10e-6
        while not self.comm.Iprobe(self.MPI.ANY_SOURCE, TAG_DEAL, status) and not stopping():
            self._check_silence()
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        self.poll(runner)

    def _check_silence(self) -> None:
        now = time.monotonic()
        for g, state in self.groups.items():
            if not state.finished and state.want == 0 and now - state.last_heard > self.timeout:
                raise PeerTimeout(f"data-parallel group {g}'s S-worker sent nothing within {self.timeout:.0f} s")

    def stop_all(self, runner) -> None:
        """A stop: every group still serving ends after its step in flight and sends its rows and
        its generation in flight back (for the in-flight save)."""
        for g, state in self.groups.items():
            if not state.finished:
                self.outbox.send(("stop",), g)
        self.outbox.flush()
        while not self.finished:
            self.wait(runner)

    def summaries(self) -> list[dict]:
        return [dict(state.summary or {}, group=g) for g, state in sorted(self.groups.items())]
