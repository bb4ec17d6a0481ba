"""Data-parallel groups, a remote group's side (the S-worker of groups 1..D-1): its own engine on
its own communicator, fed with lines by the dealer (dealer.py) as its queue runs low, its rows
sent back as its requests finish; on the dealer's stop it ends after the step in flight and sends
its generation in flight for the one in-flight save.

One ask is out at a time, for what tops its queue up to the look-ahead a job of one group keeps
(lookahead: enough waiting prompts for shared prefixes to be found among them); the dealer caps
each deal at the group's fair share of the work left (dealer.Dealer.share), so the input's end is
shared out evenly.
"""
from __future__ import annotations

import time

from fastdecode.batch.group_link import TAG_DEAL, GroupStatus, Outbox
from fastdecode.batch.line_server import LineServer

STATUS_EVERY_S = 2.0       # the dealer hears from a busy group at least this often (progress, silence)


class NoteRelay:
    """Stands in for inflight.Saved on a remote group: the notes of saved generation used or refused
    go to the dealer, whose Saved counts and prints them."""

    def __init__(self):
        self.notes: list[tuple] = []

    def note_used(self, states, refused, line_no: int) -> None:
        self.notes.append((states, refused, line_no))


class GroupRunner(LineServer):
    """Serves the lines the dealer deals to this group; rows go back to it."""

    def __init__(self, engine, leaders, inflight_mem: int, timeout: float | None = None):
        super().__init__(engine, saved=NoteRelay())
        from mpi4py import MPI
        self.comm, self.MPI = leaders, MPI
        self.outbox = Outbox(leaders)
        self.inflight_mem = inflight_mem
        self.timeout = timeout or 900.0
        self.rows: list[tuple] = []
        self.asked = self.exhausted = self.stopped = False
        self.started = time.perf_counter()
        self._last_sent = time.monotonic()

    def _write(self, line_no: int, obj: dict, code: str | None, key: bytes) -> None:
        self.rows.append((line_no, obj, code, key))

    def status(self) -> GroupStatus:
        sched = self.engine.scheduler
        return GroupStatus(self.engine.num_output_tokens, self.engine.expected_output_tokens(),
                           len(sched.running), len(sched.waiting))

    # ------------------------------------------------------------------------ the dealer

    def _take(self, msg: tuple) -> None:
        if msg[0] == "stop":
            self.stopped = True
        elif msg[0] == "lines":
            self.asked = False
            self.exhausted = msg[2]
            for line, key, saved in msg[1]:
                self._serve(line, key, saved)
        else:
            raise RuntimeError(f"the dealer sent an unexpected message {msg[0]!r}")

    def _receive(self, block: bool) -> None:
        """Take the dealer's messages; block: wait (politely) for one first."""
        status = self.MPI.Status()
        if block:
            from rworker.host.wait import wait_message
            wait_message(self.comm, 0, TAG_DEAL, "sleep", timeout=self.timeout, who="rank 0 (the dealer)")
        while self.comm.Iprobe(0, TAG_DEAL, status):
            self._take(self.comm.recv(source=0, tag=TAG_DEAL))

    def _ask(self) -> None:
        eng = self.engine
        waiting, target = len(eng.scheduler.waiting), lookahead(eng.args.max_batch)
        if self.asked or self.exhausted or waiting >= target or eng.pinned_bytes >= self.inflight_mem:
            return
        self.outbox.send(("want", target - waiting, self.status()), 0)
        self.asked = True

    def _send_rows(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.rows or self.saved.notes or force or now - self._last_sent >= STATUS_EVERY_S:
            self.outbox.send(("rows", self.rows, self.saved.notes, self.status()), 0)
            self.rows, self.saved.notes, self._last_sent = [], [], now
        self.outbox.test()

    # ------------------------------------------------------------------------ the loop

    def run(self) -> bool:
        """Serve until the dealer says the input is done and the engine is empty, or until its stop;
        True if stopped."""
        eng = self.engine
        while True:
            self._receive(block=False)
            if self.stopped:
                break
            self._ask()
            if not eng.has_unfinished():
                if self.exhausted:
                    break
                self._receive(block=True)
                continue
            for req in eng.step():
                self._finished(req)
            self._send_rows()
        self._finish()
        return self.stopped

    def summary(self) -> dict:
        eng = self.engine
        return {"requests": self.num_requests, "errors": self.num_errors, "output_tokens": eng.num_output_tokens,
                "prompt_tokens": eng.num_prompt_tokens, "steps": eng.recorder.num_steps,
                "wall_s": round(time.perf_counter() - self.started, 4), "ended_at": time.time()}

    def _finish(self) -> None:
        if self.stopped:
            msg = ("stopped", self.rows, self.saved.notes, self.summary(), self.in_flight())
        else:
            msg = ("done", self.rows, self.saved.notes, self.summary())
        self.outbox.send(msg, 0)
        self.rows, self.saved.notes = [], []
        self.outbox.flush(self.timeout, who="rank 0 (the dealer)")


def run_group(args, comm, leaders) -> int:
    """A remote group's S-worker: wait for the dealer's word, serve, close the engine (its
    R-workers end), exit 0 (rank 0 reports the job)."""
    from fastdecode.batch.schema import limits_from
    from fastdecode.engine_options import engine_args
    from fastdecode.tp.engines import s_worker_engine      # torch loads while rank 0 reads the output
    from fastdecode.tp.steps import stop_group
    from rworker.host.wait import wait_message
    wait_message(leaders, 0, TAG_DEAL, "sleep", who="rank 0 (the dealer)")   # it reads the output first
    word = leaders.recv(source=0, tag=TAG_DEAL)
    if word[0] == "skip":
        stop_group(comm, args.tensor_parallel_size)
        return 0
    engine = s_worker_engine(engine_args(args), comm)
    try:
        runner = GroupRunner(engine, leaders, limits_from(args).max_inflight_mem, args.timeout)
        runner.run()
    finally:
        engine.close()
    return 0


def lookahead(max_batch: int) -> int:
    """Lines an engine keeps waiting beyond its running ones (a job's, or a group's)."""
    return max(2 * max_batch, 64)
