"""Flood a TCP listener: hold N connections open for SECONDS, each sending a byte every 2 s (what
kept a connection alive against a per-recv timeout), reconnecting any the listener closes.

usage: flood.py HOST PORT N SECONDS
"""
from __future__ import annotations

import socket
import sys
import time


def connect(host: str, port: int) -> socket.socket | None:
    try:
        s = socket.create_connection((host, port), timeout=0.5)
    except OSError:
        return None
    s.setblocking(False)
    return s


def main() -> None:
    host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    end = time.monotonic() + seconds
    socks = [connect(host, port) for _ in range(n)]
    print(f"flooding: {sum(s is not None for s in socks)} connected", flush=True)
    while time.monotonic() < end:
        time.sleep(2.0)
        for i, s in enumerate(socks):
            try:
                if s is None:
                    raise ConnectionError
                s.send(b" ")
            except BlockingIOError:
                continue                     # its buffer is full: the listener reads nothing, keep it
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = connect(host, port)


if __name__ == "__main__":
    main()
