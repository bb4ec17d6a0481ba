"""End notices: how a rank that fails or dies tells rank 0 before the launcher ends the job.

A rank killed by SIGKILL (the OOM killer) cannot speak, and MPI cannot carry word of it: the
launcher sees its supervisor exit and kills every other process, rank 0 included, whose report
would then still say "running". So rank 0 listens on TCP for the whole job, on the addresses the
ranks reach it by (loopback for ranks beside it, the routed address towards the others: never all
interfaces); every rank learns its address at start-up (MPI) and hands it to its supervisor. A rank that
ends abnormally is reported there, by its supervisor (died: killed by a signal, an exit code) or
by itself (failed: an exception), as one JSON line with the job's token: rank 0 records it in its
report, answers "ok", and (for a dead rank, which cannot) aborts the job. A notice that cannot
be delivered changes nothing: the launcher still ends the job.

A rank whose supervisor is killed too (`kill -9` of the process the launcher started, or of the
rank's whole process group) has no one left to speak for it. So each R-worker's supervisor also
holds a connection to rank 0 open for the whole job (`SupervisorLink`), and says "bye" on it as it
ends; a connection that closes without a bye is that rank lost: rank 0 records it at once, before
the launcher's teardown (which under Open MPI signals rank 0 one `odls_base_sigkill_timeout` later)
reaches it, and again, by looking at the connections (`Listener.lost`), if that teardown ends it first.

The port is open to whatever reaches those addresses, so the listener trusts nothing it reads:
a line must come whole within MESSAGE_S and MAX_BYTES before it is parsed, and carry the job's
token; at most `pending_cap()` connections wait for their line (a quarter of the descriptors the
process has left: a flood can never take the ones the job needs to write its output), the oldest
shed first; one thread serves them all and no error ends it.
"""
from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

from rworker.host.notice_link import (  # noqa: F401  (the senders' side, imported from here too)
    ACK_S,
    MAX_BYTES,
    SUPERVISOR_FD,
    SupervisorLink,
    listen_hosts,
    route_source,
    send,
    tell_supervisor,
    whereabouts,
)

MESSAGE_S = 5.0          # a connection's whole first line, from its accept: a sender writes it at once
MAX_PENDING = 64         # connections accepted whose line has not come yet (a flood's are shed oldest first)
SETTLE_S = 0.2           # after a link closes: the launcher's kills of the others (MPICH's: at once) land


def pending_cap(limit: int = MAX_PENDING) -> int:
    """Connections the listener may hold before their line comes: at most a quarter of the file
    descriptors this process has left, so that a flood of connections can never take the ones the
    job needs for its output and report."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        used = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError, ValueError):
        return limit
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(4, min(limit, (soft - used) // 4))


class Listener:
    """Rank 0's end of the channel: one thread and a selector. It accepts on the addresses the
    ranks reach rank 0 by (`hosts`; never all interfaces), reads each connection's first line
    within MESSAGE_S and MAX_BYTES, drops what does not carry the job's token, and hands each
    notice to on_notice on a thread of its own, answers, then runs what on_notice returned (if
    anything: the abort of the job). At most `max_pending` connections wait for their line; a new
    one past that closes the oldest. No error of one connection, nor of accept (EMFILE), ends it."""

    def __init__(self, on_notice: Callable[[dict], Callable[[], None] | None], hosts: Sequence[str] = ("127.0.0.1",),
                 ranks: int | None = None, max_pending: int | None = None):
        self.token = secrets.token_hex(16)
        self.on_notice = on_notice
        self.ranks = ranks                        # highest rank that may link (None: any)
        self.max_pending = max_pending or pending_cap()
        self.watched: dict[int, tuple[socket.socket, dict]] = {}    # rank -> its supervisor's link, its hello
        self.closed: dict[int, dict] = {}         # rank -> hello, of links that closed without a bye
        self._told = threading.Lock()             # held for good by the thread that reports them
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}    # accept order: deadline, bytes so far
        self._selector = selectors.DefaultSelector()
        self._closing = False
        self.socks: list[socket.socket] = []
        for host in dict.fromkeys(hosts):
            sock = socket.create_server((host, 0), backlog=min(self.max_pending, 128))
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, ("listen",))
            self.socks.append(sock)
        threading.Thread(target=self._serve, name="end-notices", daemon=True).start()

    def address(self, hosts: Sequence[str] | None = None) -> dict:
        """What a rank needs to reach this listener: the endpoints of `hosts` (default: all it
        listens on), the host name, the token."""
        endpoints = [list(s.getsockname()[:2]) for s in self.socks]
        if hosts is not None:
            endpoints = [e for e in endpoints if e[0] in hosts] or endpoints
        return {"host": socket.gethostname(), "endpoints": endpoints, "token": self.token}

    # ------------------------------------------------------------------ the loop

    def _serve(self) -> None:
        while not self._closing:
            try:
                for key, _ in self._selector.select(timeout=0.25):
                    kind = key.data[0]
                    if kind == "listen":
                        self._accept(key.fileobj)
                    elif kind == "pending":
                        self._read(key.fileobj)
                    else:
                        self._link_event(key.fileobj, key.data[1])
                self._expire()
            except Exception:  # noqa: BLE001 - no connection's trouble may end the listener
                time.sleep(0.01)

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(max(1, self.max_pending // 2)):       # a burst, then the reads get their turn
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                return
            except OSError:               # out of descriptors (EMFILE) or the like: shed, retry later
                self._drop_oldest()
                time.sleep(0.01)
                return
            if len(self._pending) >= self.max_pending:
                self._drop_oldest()
            conn.setblocking(False)
            self._pending[conn] = (time.monotonic() + MESSAGE_S, bytearray())
            self._selector.register(conn, selectors.EVENT_READ, ("pending",))

    def _read(self, conn: socket.socket) -> None:
        _, data = self._pending[conn]
        try:
            chunk = conn.recv(MAX_BYTES + 1 - len(data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        data += chunk
        line, newline, rest = bytes(data).partition(b"\n")
        if not chunk or (not newline and len(data) > MAX_BYTES):
            self._forget(conn)
            return
        if newline:
            self._unpend(conn)
            self._message(conn, line, rest)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, (deadline, _) in list(self._pending.items()):
            if deadline < now:
                self._forget(conn)

    def _drop_oldest(self) -> None:
        if self._pending:
            self._forget(next(iter(self._pending)))

    def _unpend(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass

    def _forget(self, conn: socket.socket) -> None:
        self._unpend(conn)
        conn.close()

    # ------------------------------------------------------------------ messages

    def _message(self, conn: socket.socket, line: bytes, rest: bytes) -> None:
        notice = parse_notice(line, self.token)
        if notice is None:
            conn.close()                                  # not from this job
        elif "watch" in notice:
            self._link(conn, notice, rest)
        else:
            threading.Thread(target=self._answer, args=(conn, notice), name="end-notice", daemon=True).start()

    def _answer(self, conn: socket.socket, notice: dict) -> None:
        with conn:
            then = self.on_notice(notice)
            try:
                conn.setblocking(True)
                conn.settimeout(ACK_S)
                conn.sendall(b"ok\n")
            except OSError:
                pass
        if then is not None:
            then()

    def _link(self, conn: socket.socket, hello: dict, rest: bytes) -> None:
        """A rank's supervisor's link, for the job's length: a bye, or the rank lost."""
        rank = hello.get("watch")
        if not _is_int(rank) or rank < 1 or (self.ranks is not None and rank > self.ranks) or rank in self.watched:
            conn.close()
            return
        if rest:                                          # its bye came with its hello: it ended normally
            conn.close()
            return
        self.watched[rank] = (conn, hello)
        self._selector.register(conn, selectors.EVENT_READ, ("link", rank))

    def _link_event(self, conn: socket.socket, rank: int) -> None:
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        hello = self.watched.pop(rank, (None, {}))[1]
        conn.close()
        if data:
            return                                        # bye: it ended normally
        self.closed[rank] = hello
        threading.Thread(target=self._report_lost, name="end-notice-lost", daemon=True).start()

    def _report_lost(self) -> None:
        time.sleep(SETTLE_S)                              # the launcher's kills of the others, if it sends them
        if not self._told.acquire(blocking=False):
            return
        notice = self.lost_notice()
        then = self.on_notice(notice) if notice is not None else None
        if then is not None:
            then()

    def gone(self) -> dict[int, dict]:
        """rank -> hello of every watched supervisor whose link closed without a bye: those seen
        closing, and those closed by now (a peek: plain system calls, for a signal handler)."""
        out = dict(self.closed)
        for rank, (conn, hello) in list(self.watched.items()):
            try:
                data = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                out[rank] = hello
        return out

    def lost_notice(self) -> dict | None:
        """The notice for the ranks gone: one names it; several gone together cannot say which went
        first (the launcher killed the others: MPICH's at once), so the notice names none."""
        gone = self.gone()
        if not gone:
            return None
        if len(gone) == 1:
            rank, hello = next(iter(gone.items()))
            return {"rank": rank, "error": lost_text(hello), "abort": True, "lost": True}
        ranks = ", ".join(str(r) for r in sorted(gone))
        return {"rank": None, "abort": True, "lost": True,
                "error": f"the launcher ended the job: the processes it started for ranks {ranks} (their "
                         f"supervisors) were killed together, as a launcher kills every rank once one has died "
                         f"(the rank that died first is named on stderr)"}

    def close(self) -> None:
        self._closing = True
        for sock in self.socks:
            sock.close()


def parse_notice(line: bytes, token: str) -> dict | None:
    """A line as a notice of this job: a JSON object carrying its token (removed), else None.
    The line is at most MAX_BYTES; nesting too deep for the parser is no notice either."""
    try:
        notice = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(notice, dict):
        return None
    given = notice.pop("token", None)
    if not isinstance(given, str) or not secrets.compare_digest(given, token):
        return None
    return notice


def lost_text(hello: dict) -> str:
    return (f"{hello.get('who', 'rank ' + str(hello.get('watch')))} died: its supervisor (pid {hello.get('pid')}, the "
            f"process the launcher started) ended without a word: killed")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
