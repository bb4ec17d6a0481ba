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

CONNECT_S = 2.0          # per address tried
ACK_S = 10.0             # rank 0 writes its report (an fsync) before it answers
SEND_TRIES = 3           # a notice is sent again if no answer came (a listener busy shedding a flood)
MESSAGE_S = 5.0          # a connection's whole first line, from its accept: a sender writes it at once
MAX_BYTES = 16 << 10     # a notice or hello line, checked before it is parsed
MAX_ERROR_CHARS = 4000   # a notice's error text, cut by its sender to stay well inside MAX_BYTES
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


# ---------------------------------------------------------------------------- where rank 0 listens

def whereabouts() -> dict:
    """This rank's host, network namespace and IPv4 addresses: what rank 0 needs to pick the
    address it listens on for this rank."""
    import psutil
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = None
    ips = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    return {"host": socket.gethostname(), "netns": netns, "ips": ips}


def route_source(ip: str) -> str | None:
    """The local address this machine would send from to reach `ip` (a routing lookup: a UDP
    socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return s.getsockname()[0]
        except OSError:
            return None


def listen_hosts(ranks: list[dict]) -> list[list[str]]:
    """Rank 0: per rank (ranks[0] is rank 0's own whereabouts), the addresses of rank 0 it reaches
    it by: loopback where it shares rank 0's machine and network namespace, else the address rank
    0's routes use towards that rank's addresses (where none routes: each of rank 0's own)."""
    me = ranks[0]
    out: list[list[str]] = [[]]
    for there in ranks[1:]:
        if (there["host"], there["netns"]) == (me["host"], me["netns"]):
            out.append(["127.0.0.1"])
            continue
        routes = list(dict.fromkeys(src for ip in there["ips"] if (src := route_source(ip)) is not None
                                    and not src.startswith("127.")))
        out.append(routes or list(me["ips"]) or ["127.0.0.1"])
    return out


def _connect(address: dict, line: bytes) -> socket.socket | None:
    """A connection to rank 0's listener that took `line`, over the first endpoint that answers."""
    for host, port in address["endpoints"]:
        try:
            conn = socket.create_connection((host, port), timeout=CONNECT_S)
        except OSError:
            continue
        try:
            conn.settimeout(ACK_S)
            conn.sendall(line)
            return conn
        except OSError:
            conn.close()
    return None


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_BYTES:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def send(address: dict, notice: dict) -> bool:
    """Deliver a notice to rank 0; True once rank 0 has recorded it (tried SEND_TRIES times)."""
    if isinstance(notice.get("error"), str) and len(notice["error"]) > MAX_ERROR_CHARS:
        notice = {**notice, "error": notice["error"][:MAX_ERROR_CHARS - 3] + "..."}
    line = (json.dumps({**notice, "token": address["token"]}) + "\n").encode()
    for attempt in range(SEND_TRIES):
        conn = _connect(address, line)
        if conn is not None:
            with conn:
                try:
                    if _read_line(conn).startswith(b"ok"):
                        return True
                except OSError:
                    pass
        time.sleep(0.2 * (attempt + 1))
    return False


# ---------------------------------------------------------------------------- child -> supervisor

SUPERVISOR_FD = "FASTDECODE_SUPERVISOR_FD"     # in a supervised child: the pipe to its supervisor


def tell_supervisor(address: dict) -> None:
    """In a supervised child: pass rank 0's address up to the supervisor (read after this process ends)."""
    fd = int(os.environ.get(SUPERVISOR_FD) or -1)
    if fd < 0:
        return
    try:
        os.write(fd, json.dumps(address).encode() + b"\n")
        os.close(fd)
    except OSError:
        pass


class SupervisorLink:
    """In a supervisor: reads rank 0's address from its child's pipe as soon as the child passes it up
    and (an R-worker's supervisor: `who` given) opens the link rank 0 watches; `bye` as it ends."""

    def __init__(self, fd: int, rank: int, who: str | None):
        self.fd, self.rank, self.who = fd, rank, who
        self.conn: socket.socket | None = None
        self._address: dict | None = None
        self._read, self._linked = threading.Event(), threading.Event()
        threading.Thread(target=self._run, name="rank0-link", daemon=True).start()

    def _run(self) -> None:
        data = b""
        try:
            while not data.endswith(b"\n") and len(data) < MAX_BYTES:
                chunk = os.read(self.fd, 4096)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        finally:
            os.close(self.fd)
        try:
            address = json.loads(data)
        except ValueError:
            address = None
        self._address = address if isinstance(address, dict) else None
        self._read.set()
        if self._address is not None and self.who is not None:
            hello = {"watch": self.rank, "who": self.who, "pid": os.getpid(), "token": self._address.get("token")}
            try:
                self.conn = _connect(self._address, (json.dumps(hello) + "\n").encode())
            except (KeyError, TypeError):
                self.conn = None
        self._linked.set()

    def address(self, wait_s: float = 1.0) -> dict | None:
        """Rank 0's address, once the child has ended (its pipe then closes, unless a process it
        started still holds it: at most wait_s)."""
        self._read.wait(wait_s)
        return self._address

    def bye(self) -> None:
        """This supervisor ends normally (after whatever it reported): not a lost rank."""
        if self._read.is_set():
            self._linked.wait(CONNECT_S)      # a link being opened: close it properly
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.sendall(b"bye\n")
            except OSError:
                pass
            conn.close()


def read_from_child(fd: int) -> dict | None:
    """In the supervisor, once its child has ended: the address the child passed up, if any."""
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        address = json.loads(data)
    except ValueError:
        return None
    return address if isinstance(address, dict) else None

