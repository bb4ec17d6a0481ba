"""Flood a TCP listener: hold N connections open for SECONDS, each sending a byte every 2 s (what
kept a connection alive against a per-recv timeout), reconnecting any the listener closes.

usage: flood.py HOST PORT N SECONDS
"""
from __future__ import annotations

import socket
import sys
import time


def connect(host: str, port: int) -> socket.socket | None:
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect_ex((host, port))
    except OSError:
        s.close()
        return None
    return s


def main() -> None:
    host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    socks = [connect(host, port) for _ in range(n)]
    end = time.monotonic() + seconds
    print("flooding", flush=True)
    while time.monotonic() < end:
        time.sleep(2.0)
        for i, s in enumerate(socks):
            try:
                if s is None:
                    raise OSError
                s.send(b" ")
            except BlockingIOError:
                continue                     # still connecting, or its buffer is full: keep it
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = connect(host, port)


if __name__ == "__main__":
    main()
