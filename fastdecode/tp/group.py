"""The S-ranks' tensor-parallel group: torch.distributed over ranks 0..T-1, NCCL on GPUs, gloo on
CPUs, and the MPI communicator of the same ranks for small host values.

Rendezvous: rank 0 opens torch's TCPStore on a free port and tells every other S-rank, over MPI,
the address of its own it reaches rank 0 by (loopback beside it, else the routed one: the end
notices' rule, rworker/host/notice_link.py); the store itself listens on every interface of rank
0's node, as torch's does. Collectives wait with a deadline (gloo's `wait(timeout)`; NCCL's own
watchdog at the group's timeout): rank 0 waits `timeout` for the others, the others three times
as long for rank 0 (so rank 0, which sees them all, names a silent peer first, as with the
R-workers; which one is silent, the followers' heartbeats say: heartbeat.py). A collective that fails outright (a peer's connection closed: it died) waits a
moment for the dead rank's supervisor to end the job naming it, before failing on its own.

Shapes: n = rows, c = columns of one rank, H_l = heads of one rank, D = head_dim.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from fastdecode.tp import heartbeat
from rworker.host.end_notice import listen_hosts, whereabouts
from rworker.host.wait import PeerTimeout

LOST_PEER_GRACE_S = 10.0      # a collective broke: the dead peer's supervisor aborts the job within this
DEFAULT_TIMEOUT_S = 900.0     # rank 0's wait on the other S-ranks without --timeout (MPIBackend's first)
# gloo's worker thread drops the last reference to a finished collective's tensors itself, and
# needs the interpreter lock for it; a rank that holds the lock from its last collective to its exit
# (MPI waits keep it) leaves that thread asking at finalization, where Python ends the thread and
# gloo's loop calls std::terminate (SIGABRT). Ending the group sleeps this long first: the lock free
GLOO_SETTLE_S = 0.05


class PeerLost(RuntimeError):
    """A collective failed: another S-rank's connection closed."""


class TPGroup:
    """This S-rank's view of the group (rank 0 leads); made with `start`, collectively."""

    def __init__(self, comm, device: torch.device, timeout_s: float | None):
        self.comm = comm                             # MPI communicator of the S-ranks (rank r = world rank r)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        base = float(timeout_s or DEFAULT_TIMEOUT_S)
        self.timeout_s = base if self.rank == 0 else 3 * base
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        self.broken = False                          # a collective failed: the group is not ended politely

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, comm, device: torch.device, timeout_s: float | None) -> TPGroup:
        """Collective over the S-ranks: join torch.distributed (rank 0's store, its address sent over MPI)."""
        g = cls(comm, device, timeout_s)
        pg_timeout = datetime.timedelta(seconds=3 * float(timeout_s or DEFAULT_TIMEOUT_S))
        where = comm.gather(whereabouts(), root=0)
        if g.rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, g.size, is_master=True, timeout=pg_timeout, wait_for_workers=False)
            hosts = listen_hosts(where)
            comm.scatter([None] + [(hosts[r][0], store.port) for r in range(1, g.size)], root=0)
        else:
            host, port = comm.scatter(None, root=0)
            store = dist.TCPStore(host, port, g.size, is_master=False, timeout=pg_timeout)
        kwargs = {"device_id": device} if g.backend == "nccl" else {}
        # the group's own timeout is this rank's wait: gloo's threads give up with it, so ending
        # the group after a timeout (its destructor joins them) takes no longer than the wait did
        dist.init_process_group(g.backend, store=store, rank=g.rank, world_size=g.size, timeout=g._timeout, **kwargs)
        g._store, g.hosts = store, [w["host"] for w in where] if g.rank == 0 else []
        if g.rank > 0:
            heartbeat.start_beating(host, port, g.rank)
        return g

    # ------------------------------------------------------------------ waiting

    def _wait(self, work) -> None:
        try:
            if self.backend == "gloo":
                work.wait(self._timeout)
            else:
                work.wait()            # stream-ordered; the group's watchdog bounds it
        except RuntimeError as e:
            raise self._failure(e) from None

    def _failure(self, e: BaseException) -> BaseException:
        self.broken = True
        text = " ".join(str(e).split())[:300]
        if "timed out" in text.lower() or "timeout" in text.lower():
            who, why = (self._silent() if self.leader
                        else ("rank 0 (S-worker) or another tensor-parallel S-rank", ""))
            return PeerTimeout(f"no reply from {who} within {self.timeout_s:.0f} s{why}")
        time.sleep(LOST_PEER_GRACE_S)    # a dead rank's supervisor ends the job naming it meanwhile
        return PeerLost(f"a tensor-parallel collective failed (another S-rank is gone?): {text}")

    def _silent(self) -> tuple[str, str]:
        """Rank 0, after a timeout: (who, why): the S-ranks whose heartbeat stopped, else all of them."""
        silent = heartbeat.silent_ranks(self._store, range(1, self.size))
        if not silent:
            return f"the tensor-parallel S-ranks 1..{self.size - 1}", ""
        names = ", ".join(f"rank {r} (tensor-parallel S-rank on {self.hosts[r]})" for r in silent)
        return names, ": its heartbeat stopped (stopped, hung or cut off); the other S-ranks wait on it"

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the S-ranks of t (each rank's partial), in place and returned."""
        self._wait(dist.all_reduce(t, async_op=True))
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's t, stacked [T, *t.shape] on rank 0 (None elsewhere); t contiguous, one shape."""
        t = t.contiguous()
        out = torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype, device=t.device) if self.leader else None
        self._wait(dist.gather(t, list(out.unbind(0)) if out is not None else None, dst=0, async_op=True))
        return out

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """t [n, c] -> [n, T*c] on rank 0 (rank r's columns r*c..), None elsewhere."""
        parts = self.gather(t)                                   # [T, n, c]
        return None if parts is None else parts.permute(1, 0, 2).reshape(t.shape[0], -1)

    def gather_heads(self, t: torch.Tensor) -> torch.Tensor | None:
        """t [..., n, H_l, D] -> [..., n, T*H_l, D] on rank 0 (rank r's heads r*H_l..), None elsewhere."""
        parts = self.gather(t)                                   # [T, ..., n, H_l, D]
        if parts is None:
            return None
        lead = t.dim() - 2                                       # the dims before the heads
        order = list(range(1, lead + 1)) + [0, lead + 1, lead + 2]
        return parts.permute(*order).reshape(*t.shape[:-2], -1, t.shape[-1])

    def scatter_heads(self, full: torch.Tensor | None, n: int, heads: int, d: int,
                      dtype: torch.dtype) -> torch.Tensor:
        """Rank 0's full [n, T*heads, D] -> this rank's heads [n, heads, D] (full: None on the others)."""
        out = torch.empty((n, heads, d), dtype=dtype, device=self.device)
        parts = [full[:, r * heads:(r + 1) * heads].contiguous() for r in range(self.size)] if self.leader else None
        self._wait(dist.scatter(out, parts, src=0, async_op=True))
        return out

    def min_int(self, value: int) -> int:
        """The smallest of every S-rank's value (MPI, host side)."""
        from mpi4py import MPI
        return int(self.comm.allreduce(int(value), op=MPI.MIN))

    def close(self) -> None:
        if dist.is_initialized() and not self.broken:   # a broken group's threads may still wait on a peer
            time.sleep(GLOO_SETTLE_S)
            dist.destroy_process_group()
