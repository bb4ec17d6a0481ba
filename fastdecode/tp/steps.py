"""What rank 0 tells the other S-ranks each step, and how they read it (torch-free: rank 0's
shutdown of a job that never made an engine sends the stop from launch/mpi_env.py).

One message per runner call (a prefill, a decode, a mixed step), rank 0 to each follower on the
world communicator (tag TAG_STEP, which no R-worker ever receives), pickled by mpi4py:

    {"kind": "start" | "prefill" | "decode" | "mixed" | "stop",
     "frees": (seq ids [f], workers [f]),   the sequences freed since the last message (KV and the
                                            runner's kept chunks), applied before this one's work
     "meta": [B, 5] int64,                  decode rows as the runner lays them out (runner._decode_meta)
     "shadows": [Shadow],                   prefill rows: what the runner reads of each sequence
     "retired": [entry ids]}                shared-prefix K/V rank 0 dropped: dropped after the work

Point-to-point messages, not a collective: a follower waits for its next one politely (polling
with back-off, wait.py), as an R-worker waits for its control message, and with the same
timeout that names rank 0 when it stays silent; a blocking MPI broadcast would spin a core while
rank 0 reads input or writes output (and torch.distributed's broadcast of objects goes through
device tensors and a blocking wait).
"""
from __future__ import annotations

from dataclasses import dataclass, field

TAG_STEP = 60                  # not a tag of the R-worker protocol (rworker/protocol/control.py)


@dataclass(slots=True)
class Shadow:
    """A sequence of a prefill as a follower's runner needs it (runner._prefill_plan and after)."""
    seq_id: int
    worker: int = -1
    prefilled: int = 0                  # KV tokens already stored (a chunk starts there)
    prefill_to: int = 0                 # where this chunk ends (0: the whole kv_len)
    kv_len: int = 0
    prompt_len: int = 0
    output_ids: list = field(default_factory=list)   # [] for a fresh sequence, else its newest token
    sample_index: int = 0
    prompt_logprobs: int | None = None
    tokens: list = field(default_factory=list)       # token ids of this chunk's positions
    reserve: int = 0                    # KV tokens its worker reserves at its first chunk
    fork: tuple | None = None           # (entry id, source seq id, tokens): it starts from a shared prefix
    capture: tuple | None = None        # (entry id, tokens): it keeps its prefix K/V for others


def stop_message() -> dict:
    return {"kind": "stop"}


def start_message() -> dict:
    return {"kind": "start"}


def send_all(comm, followers: range, message: dict, policy: str = "adaptive", timeout: float | None = None) -> None:
    """Rank 0: `message` to every follower, waiting (politely, at most `timeout`) until each has it."""
    from rworker.host.wait import PeerTimeout, wait_all
    requests = [comm.isend(message, dest=r, tag=TAG_STEP) for r in followers]
    try:
        wait_all(requests, policy, timeout, who=f"the tensor-parallel S-ranks {followers.start}..{followers.stop - 1}")
    except PeerTimeout:
        silent = [r for r, req in zip(followers, requests) if not req.Test()]     # the ones that took nothing
        if not silent:
            raise
        names = ", ".join(f"rank {r} (tensor-parallel S-rank)" for r in silent)
        raise PeerTimeout(f"no reply from {names} within {timeout:.0f} s: it did not take rank 0's step "
                          f"message") from None


def receive(comm, policy: str = "adaptive", timeout: float | None = None) -> dict:
    """A follower: rank 0's next message (PeerTimeout naming rank 0 after `timeout`)."""
    from rworker.host.wait import wait_message
    wait_message(comm, 0, TAG_STEP, policy, timeout, who="rank 0 (S-worker)")
    return comm.recv(source=0, tag=TAG_STEP)


def stop_group(comm, s_ranks: int = 1) -> None:
    """Rank 0, before any HELLO: end the R-workers (ranks s_ranks..) and a tensor-parallel
    S-worker's other ranks (1..s_ranks-1) cleanly (they wait in the node-layout collective, then
    for a control message, or for the step message that says start or stop)."""
    if comm is None or comm.Get_size() == 1:
        return
    from rworker.host.wait import node_layout
    from rworker.protocol import control as P
    node_layout(comm, s_ranks)
    for r in range(1, min(s_ranks, comm.Get_size())):
        comm.send(stop_message(), dest=r, tag=TAG_STEP)
    bye = P.control(P.SHUTDOWN)
    for r in range(s_ranks, comm.Get_size()):
        comm.Send(bye, dest=r, tag=P.TAG_CTRL)
