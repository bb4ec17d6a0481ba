"""End notices: how a rank that fails or dies tells rank 0 before the launcher ends the job.

A rank killed by SIGKILL (the OOM killer) cannot speak, and MPI cannot carry word of it: the
launcher sees its supervisor exit and kills every other process, rank 0 included, whose report
would then still say "running". So rank 0 listens on a TCP port for the whole job; every rank
learns its address at start-up (an MPI broadcast) and hands it to its supervisor. A rank that
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
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

CONNECT_S = 2.0          # per address tried
ACK_S = 10.0             # rank 0 writes its report (an fsync) before it answers
MAX_BYTES = 64 << 10
SETTLE_S = 0.2           # after a link closes: the launcher's kills of the others (MPICH's: at once) land


class Listener:
    """Rank 0's end of the channel: a daemon thread that hands each notice to on_notice, answers,
    then runs what on_notice returned (if anything: the abort of the job)."""

    def __init__(self, on_notice: Callable[[dict], Callable[[], None] | None]):
        self.token = secrets.token_hex(16)
        self.sock = socket.create_server(("", 0), backlog=16)
        self.on_notice = on_notice
        self.watched: dict[int, tuple[socket.socket, dict]] = {}    # rank -> its supervisor's link, its hello
        self.closed: dict[int, dict] = {}         # rank -> hello, of links that closed without a bye
        self._told = threading.Lock()             # held for good by the thread that reports them
        threading.Thread(target=self._serve, name="end-notices", daemon=True).start()

    def address(self) -> dict:
        """What every rank needs to reach this listener: host name, IPv4 addresses, port, token."""
        import psutil
        ips = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")]
        return {"host": socket.gethostname(), "ips": ips, "port": self.sock.getsockname()[1], "token": self.token}

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(ACK_S)
            try:
                line, rest = _read_line(conn).partition(b"\n")[::2]
                notice = json.loads(line)
            except (OSError, ValueError):
                return
            if not isinstance(notice, dict) or notice.pop("token", None) != self.token:
                return                                   # not from this job
            if "watch" in notice:
                then = self._watch(conn, notice, rest)
                if then is not None:
                    then()
                return
            then = self.on_notice(notice)
            try:
                conn.sendall(b"ok\n")
            except OSError:
                pass
        if then is not None:
            then()

    def _watch(self, conn: socket.socket, hello: dict, rest: bytes):
        """A rank's supervisor's link, for the job's length: a bye, or the rank lost."""
        try:
            rank = int(hello["watch"])
        except (TypeError, ValueError):
            return None
        conn.settimeout(None)
        self.watched[rank] = (conn, hello)
        try:
            data = rest or conn.recv(64)
        except OSError:
            data = b""
        self.watched.pop(rank, None)
        if data:
            return None                                  # bye: it ended normally
        self.closed[rank] = hello
        time.sleep(SETTLE_S)                             # the launcher's kills of the others, if it sends them
        if not self._told.acquire(blocking=False):
            return None
        notice = self.lost_notice()
        return self.on_notice(notice) if notice is not None else None

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
        self.sock.close()


def lost_text(hello: dict) -> str:
    return (f"{hello.get('who', 'rank ' + str(hello.get('watch')))} died: its supervisor (pid {hello.get('pid')}, the "
            f"process the launcher started) ended without a word: killed")


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_BYTES:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _connect(address: dict, line: bytes) -> socket.socket | None:
    """A connection to rank 0's listener that took `line`, over the first address that answers."""
    hosts = (["127.0.0.1"] if address["host"] == socket.gethostname() else []) + list(address["ips"]) + \
        [address["host"]]
    for host in hosts:
        try:
            conn = socket.create_connection((host, address["port"]), timeout=CONNECT_S)
        except OSError:
            continue
        try:
            conn.settimeout(ACK_S)
            conn.sendall(line)
            return conn
        except OSError:
            conn.close()
    return None


def send(address: dict, notice: dict) -> bool:
    """Deliver a notice to rank 0; True once rank 0 has recorded it."""
    conn = _connect(address, (json.dumps({**notice, "token": address["token"]}) + "\n").encode())
    if conn is None:
        return False
    with conn:
        try:
            return _read_line(conn).startswith(b"ok")
        except OSError:
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

