"""Fault injection for tests: FASTDECODE_INJECT_FAULT="<rank>:<point>[:<how>[:<nth>]]" (the world rank
under a launcher, as the job's messages name it).

Points: hello, prefill, decode, kv_export, kv_import (R-workers, on that control message; every
control kind's name is one), prefill-stream (an R-worker, after a prefill's first layer of K/V is
appended: mid-stream), step (the S-worker's engine step; a tensor-parallel S-rank's runner call),
rewrite (rank 0's final rewrite of the output, before it replaces the file), link (an R-worker
answering LINK: `enospc` makes it refuse the shared-memory link, so its decode rows stay on MPI).
nth: fire on the nth time the point is reached (default the first).
How: raise (default) an exception; exit: die at once without MPI's help (a crash, exit code 17);
kill: SIGKILL itself (the OOM killer, `kill -9`); hang: stop answering (a stuck node); enospc: an
OSError "No space left on device"; oom: a MemoryError (an allocation that failed, as a GPU's does).
"""
from __future__ import annotations

import errno
import os
import signal
import time

HOWS = ("raise", "exit", "kill", "hang", "enospc", "oom")


class InjectedFault(RuntimeError):
    pass


_reached: dict[str, int] = {}     # point -> times reached in this process


def check(rank: int, point: str) -> None:
    """`rank`: this process's rank in its communicator; under a launcher the world rank counts (a
    data-parallel group's ranks are numbered within the group)."""
    spec = os.environ.get("FASTDECODE_INJECT_FAULT")
    if not spec:
        return
    from rworker.host.launcher_env import world_rank_or
    parts = spec.split(":")
    if parts[:2] != [str(world_rank_or(rank)), point]:
        return
    how = parts[2] if len(parts) > 2 and parts[2] else "raise"
    _reached[point] = _reached.get(point, 0) + 1
    if len(parts) > 3 and _reached[point] != int(parts[3]):
        return
    if how == "exit":
        os._exit(17)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        while True:
            time.sleep(3600)
    if how == "oom":
        raise MemoryError(f"out of memory (FASTDECODE_INJECT_FAULT={spec})")
    if how == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (FASTDECODE_INJECT_FAULT={spec})")
    raise InjectedFault(f"injected fault at {point} (FASTDECODE_INJECT_FAULT={spec})")
