"""Which tensor-parallel S-rank went silent, when a collective times out on rank 0.

A collective that times out says only that the group did not finish: every rank waits on the
slowest, so rank 1 waiting on a stopped rank 2 looks the same to rank 0 as rank 2 itself. Each
follower therefore beats (a counter in rank 0's TCPStore, from a thread of its own, every
BEAT_S): a rank blocked in a collective still beats (the wait releases the interpreter), a rank
that is stopped (SIGSTOP), hung in C code holding the interpreter, or cut off does not. After a
timeout rank 0 reads the counters twice, SETTLE_BEATS beats apart; those that did not move name
the silent ranks.
"""
from __future__ import annotations

import datetime
import threading
import time

BEAT_S = 0.5
SETTLE_BEATS = 4         # rank 0 watches this many beats' time before it names a rank


def key(rank: int) -> str:
    return f"fastdecode/beat/{rank}"


def start_beating(host: str, port: int, rank: int) -> None:
    """A follower: beat for the life of the process, on a store connection of its own."""
    import torch.distributed as dist
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))

    def beat() -> None:
        while True:
            try:
                store.add(key(rank), 1)
            except Exception:  # noqa: BLE001 - rank 0 gone: the job is ending, nothing to tell
                return
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="tp-heartbeat", daemon=True).start()


def silent_ranks(store, followers: range) -> list[int]:
    """Rank 0: the followers whose beat did not move over SETTLE_BEATS beats ([] if every one
    beats, or the counters cannot be read)."""
    try:
        before = [store.add(key(r), 0) for r in followers]
        time.sleep(SETTLE_BEATS * BEAT_S)
        after = [store.add(key(r), 0) for r in followers]
    except Exception:  # noqa: BLE001 - the store is rank 0's own: unreadable means no answer
        return []
    return [r for r, b, a in zip(followers, before, after) if a == b]
