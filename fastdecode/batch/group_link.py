"""What the dealer (dealer.py) and the other data-parallel groups (group_runner.py) say to each
other: pickled tuples on TAG_DEAL over the groups' S-workers' communicator, sent without
blocking the sender's steps.

group -> dealer: ("want", n, status) | ("rows", rows, notes, status)
                 | ("done", rows, notes, summary) | ("stopped", rows, notes, summary, in_flight)
dealer -> group: ("start",) | ("skip",) | ("lines", [(line, key, saved)], exhausted) | ("stop",)

A row is (line_no, row object, error code or None, line key); a note is an earlier run's saved
generation used or refused: (states, refusals, line_no), as inflight.Saved.note_used takes it.
"""
from __future__ import annotations

from dataclasses import dataclass

TAG_DEAL = 41


@dataclass(frozen=True)
class GroupStatus:
    """A group's progress for the job's progress line."""
    output_tokens: int = 0
    expected_tokens: float = 0.0
    running: int = 0
    waiting: int = 0

    def __add__(self, other: GroupStatus) -> GroupStatus:
        return GroupStatus(self.output_tokens + other.output_tokens, self.expected_tokens + other.expected_tokens,
                           self.running + other.running, self.waiting + other.waiting)


class Outbox:
    """Nonblocking sends whose buffers live until they complete (test() frees the finished ones)."""

    def __init__(self, comm):
        self.comm = comm
        self.requests: list = []

    def send(self, msg: tuple, dest: int) -> None:
        self.requests.append(self.comm.isend(msg, dest=dest, tag=TAG_DEAL))

    def test(self) -> None:
        self.requests = [r for r in self.requests if not r.Test()]

    def flush(self, timeout: float | None = None, who: str = "the dealer") -> None:
        from rworker.host.wait import wait_all
        requests, self.requests = self.requests, []
        wait_all(requests, "sleep", timeout=timeout, who=who)
