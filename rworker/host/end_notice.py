"""End notices: how a rank that fails or dies tells rank 0 before the launcher ends the job.

A rank killed by SIGKILL (the OOM killer) cannot speak, and MPI cannot carry word of it: the
launcher sees its supervisor exit and kills every other process, rank 0 included, whose report
would then still say "running". So rank 0 listens on a TCP port for the whole job; every rank
learns its address at start-up (an MPI broadcast) and hands it to its supervisor. A rank that
ends abnormally is reported there, by its supervisor (died: killed by a signal, an exit code) or
by itself (failed: an exception), as one JSON line with the job's token: rank 0 records it in its
report, answers "ok", and (for a dead rank, which cannot) aborts the job. A notice that cannot
be delivered changes nothing: the launcher still ends the job.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
from collections.abc import Callable

CONNECT_S = 2.0          # per address tried
ACK_S = 10.0             # rank 0 writes its report (an fsync) before it answers
MAX_BYTES = 64 << 10


class Listener:
    """Rank 0's end of the channel: a daemon thread that hands each notice to on_notice, answers,
    then runs what on_notice returned (if anything: the abort of the job)."""

    def __init__(self, on_notice: Callable[[dict], Callable[[], None] | None]):
        self.token = secrets.token_hex(16)
        self.sock = socket.create_server(("", 0), backlog=16)
        self.on_notice = on_notice
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
                notice = json.loads(_read_line(conn))
            except (OSError, ValueError):
                return
            if not isinstance(notice, dict) or notice.pop("token", None) != self.token:
                return                                   # not from this job
            then = self.on_notice(notice)
            try:
                conn.sendall(b"ok\n")
            except OSError:
                pass
        if then is not None:
            then()

    def close(self) -> None:
        self.sock.close()


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_BYTES:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def send(address: dict, notice: dict) -> bool:
    """Deliver a notice to rank 0; True once rank 0 has recorded it."""
    line = (json.dumps({**notice, "token": address["token"]}) + "\n").encode()
    hosts = (["127.0.0.1"] if address["host"] == socket.gethostname() else []) + list(address["ips"]) + \
        [address["host"]]
    for host in hosts:
        try:
            with socket.create_connection((host, address["port"]), timeout=CONNECT_S) as conn:
                conn.settimeout(ACK_S)
                conn.sendall(line)
                return _read_line(conn).startswith(b"ok")
        except OSError:
            continue
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

