"""Fault injection for tests: FASTDECODE_INJECT_FAULT="<rank>:<point>[:<how>]".

Points: hello, prefill, decode (R-workers), step (the S-worker's engine step), rewrite (rank 0's
final rewrite of the output, before it replaces the file).
How: raise (default) an exception; exit: die at once without MPI's help (a crash, exit code 17);
kill: SIGKILL itself (the OOM killer, `kill -9`); hang: stop answering (a stuck node); enospc: an
OSError "No space left on device".
"""
from __future__ import annotations

import errno
import os
import signal
import time

HOWS = ("raise", "exit", "kill", "hang", "enospc")


class InjectedFault(RuntimeError):
    pass


def check(rank: int, point: str) -> None:
    spec = os.environ.get("FASTDECODE_INJECT_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    if parts[:2] != [str(rank), point]:
        return
    how = parts[2] if len(parts) > 2 else "raise"
    if how == "exit":
        os._exit(17)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        while True:
            time.sleep(3600)
    if how == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (FASTDECODE_INJECT_FAULT={spec})")
    raise InjectedFault(f"injected fault at {point} (FASTDECODE_INJECT_FAULT={spec})")
