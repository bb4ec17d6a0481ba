"""The ranks' side of the end notices (end_notice.py holds rank 0's listener): where rank 0 can
be reached from each rank, delivering a notice and waiting for rank 0's "ok", and the link an
R-worker's supervisor holds to rank 0 for the whole job, closed with a "bye" when it ends well."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

CONNECT_S = 2.0          # per address tried
ACK_S = 10.0             # rank 0 writes its report (an fsync) before it answers
SEND_TRIES = 3           # a notice is sent again if no answer came (a listener busy shedding a flood)
MAX_BYTES = 16 << 10     # a notice or hello line, checked before it is parsed
MAX_ERROR_CHARS = 4000   # a notice's error text, cut by its sender to stay well inside MAX_BYTES


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


def connect(address: dict, line: bytes) -> socket.socket | None:
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
        conn = connect(address, line)
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
MPI_UP = b"mpi-up\n"       # the child's line once every rank is past MPI's start-up (before the address)


def tell_supervisor_mpi_up() -> None:
    """In a supervised child: MPI is up on every rank. From here a rank that dies is one the launcher
    sees die (it ends the job); before, only the supervisor can end the ranks waiting in MPI_Init."""
    fd = int(os.environ.get(SUPERVISOR_FD) or -1)
    if fd >= 0:
        try:
            os.write(fd, MPI_UP)
        except OSError:
            pass


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
        self.mpi_up = threading.Event()          # the child said MPI is up on every rank
        threading.Thread(target=self._run, name="rank0-link", daemon=True).start()

    def _run(self) -> None:
        data = b""
        try:
            while not data.endswith(b"\n") and len(data) < MAX_BYTES:
                chunk = os.read(self.fd, 4096)
                if not chunk:
                    break
                data += chunk
                if data.startswith(MPI_UP):
                    self.mpi_up.set()
                    data = data[len(MPI_UP):]
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
                self.conn = connect(self._address, (json.dumps(hello) + "\n").encode())
            except (KeyError, TypeError):
                self.conn = None
        self._linked.set()

    def address(self, wait_s: float = 1.0) -> dict | None:
        """Rank 0's address, once the child has ended (its pipe then closes, unless a process it
        started still holds it: at most wait_s)."""
        self._read.wait(wait_s)
        return self._address

    def saw_mpi_up(self, wait_s: float = 1.0) -> bool:
        """Whether the child said MPI was up, asked once it has ended (as address())."""
        self._read.wait(wait_s)
        return self.mpi_up.is_set()

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

