"""A follower S-rank's process (ranks 1..T-1 of `--tensor-parallel-size T`): it builds what rank 0's
engine builds of the S-part (its shard of the weights, its share of the S-worker's KV tier) by the
same assembly (engine/assembly.py), then runs rank 0's runner calls until rank 0 says stop. It
ignores the stop signals (rank 0 finishes the step and stops it, as it does the R-workers), and any
failure ends the job naming this rank, as an R-worker's does.
"""
from __future__ import annotations

from fastdecode.engine.args import EngineArgs, resolve_device
from fastdecode.engine.assembly import adopt, build
from fastdecode.tp import steps
from fastdecode.tp.context import join
from fastdecode.tp.follower import FollowerRunner, MirrorPrefix
from rworker.host import faults
from rworker.host.wait import choose_policy, node_layout


class Follower:
    """A follower's side of the assembly (engine/assembly.py): it joins the group rank 0 started,
    and learns the R-workers from rank 0, whose gather reaches them (rpart/head_gather.py)."""

    @staticmethod
    def join(comm, args: EngineArgs, config):
        return join(comm, args.tensor_parallel_size, config, resolve_device(args.device), args.timeout)

    @staticmethod
    def workers(parts, comm, others):
        from fastdecode.rpart.base import WorkerInfo
        from fastdecode.rpart.head_gather import HeadFollower
        timeout = parts.args.timeout
        message = steps.receive(comm, timeout=3 * timeout if timeout else None)
        c = parts.tp.config
        return HeadFollower([WorkerInfo(**w) for w in message["workers"]], parts.tp.group, c.num_heads,
                            c.num_kv_heads, c.head_dim, parts.device)

    @staticmethod
    def say(parts) -> None:
        pass


class FollowerEngine:
    def __init__(self, args: EngineArgs, comm, layout: tuple):
        self.comm = comm
        adopt(self, build(args, comm, Follower, layout, say=False))
        self.runner = FollowerRunner(self.model, self.backend, frozenset(), self.args.pipeline_depth)
        self.runner.prefix = MirrorPrefix()
        self.policy = choose_policy(layout[0], layout[0])
        self.wait_s = 3 * self.args.timeout if self.args.timeout else None      # rank 0 is named silent past it

    def serve(self) -> None:
        import torch
        try:
            with torch.inference_mode():
                while True:
                    message = steps.receive(self.comm, self.policy, self.wait_s)
                    if message["kind"] == "stop":
                        return
                    faults.check(self.tp.rank, "step")
                    self.runner.run(message)
        finally:
            self.backend.close()
            self.tp.group.close()


def run_follower(args: EngineArgs, comm, end_notice_to: dict | None = None) -> int:
    """A follower rank's life: wait for rank 0's start (or stop: a job with nothing to serve), build,
    serve. Any failure ends the job naming this rank (on stderr, and to rank 0's report through its
    end-notice listener); rank 0 silent past the timeout is named as the silent one (exit 75)."""
    from rworker.host.wait import end_job_on_error
    try:
        layout = node_layout(comm, args.tensor_parallel_size)       # collective: every rank calls it
        first = steps.receive(comm, timeout=3 * args.timeout if args.timeout else None)
        if first["kind"] == "stop":
            return 0
        FollowerEngine(args, comm, layout).serve()
    except BaseException as e:  # noqa: BLE001 - every failure must end the job, not hang it
        from fastdecode.launch.ranks import role_name
        from fastdecode.model.config import ConfigError
        end_job_on_error(comm, e, role_name(comm.Get_rank()), end_notice_to, 2 if isinstance(e, ConfigError) else 1)
    return 0
