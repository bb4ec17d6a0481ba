"""A follower S-rank's process (ranks 1..T-1 of `--tensor-parallel-size T`): it builds what rank 0's
engine builds of the S-part (its shard of the weights, its share of the S-worker's KV tier, the
runner) from the same command line, in the same order of collectives, then runs rank 0's runner
calls until rank 0 says stop. It ignores the stop signals (rank 0 finishes the step and stops it,
as it does the R-workers), and any failure ends the job naming this rank, as an R-worker's does.
"""
from __future__ import annotations

from fastdecode.engine import rpart_setup
from fastdecode.engine.args import EngineArgs, resolve_batch_limits, resolve_device, resolve_dtypes
from fastdecode.engine.kv_tiers import choose_tier
from fastdecode.launch.ranks import Roles
from fastdecode.model.quantization import weight_format
from fastdecode.model.source import read_config, resolve_model
from fastdecode.model.spart import SPart
from fastdecode.model.weights import load_weights
from fastdecode.tp import steps
from fastdecode.tp.context import join
from fastdecode.tp.follower import FollowerRunner, MirrorPrefix
from rworker.host import faults
from rworker.host.wait import choose_policy, node_layout


class FollowerEngine:
    def __init__(self, args: EngineArgs, comm, layout: tuple):
        self.args, self.comm, self.layout = args, comm, layout
        s_ranks = args.tensor_parallel_size
        self.source = resolve_model(args.model, args.revision)
        self.config = read_config(self.source)
        max_model_len = self.config.resolve_max_model_len(args.max_model_len)
        self.tp = join(comm, s_ranks, self.config, resolve_device(args.device), args.timeout)
        self.device = self.tp.device
        self.dtype, self.kv_dtype = resolve_dtypes(args, self.device, self.config)
        self.args = args = resolve_batch_limits(args, self.device, self.config, self.dtype)
        self.s_cores = self._setup_threads()
        self.tier = choose_tier(args.device_kv, args.device_kv_memory, self.device, self.kv_dtype,
                                Roles(comm.Get_size(), s_ranks).members, layout[0])
        weights = load_weights(self.source, self.config, self.dtype, self.device,
                               weight_format(args.quantization, self.source), self.tp.shard)
        self.model = SPart(self.tp.config, weights, self.device, self.dtype, max_model_len=max_model_len,
                           tp=self.tp.group, vocab_size=self.config.vocab_size)
        del weights
        self.backend = rpart_setup.make_backend(self, comm)
        self.runner = FollowerRunner(self.model, self.backend, frozenset(), args.pipeline_depth)
        self.runner.prefix = MirrorPrefix()
        self.policy = choose_policy(layout[0], layout[0])
        self.wait_s = 3 * args.timeout if args.timeout else None      # rank 0 is named silent past it

    def _setup_threads(self) -> int:
        """Torch threads on a CPU (MPI launchers make torch default to one): its share of the node."""
        import torch

        from rworker.host.cores import s_worker_cores
        ranks_here, s_here, _ = self.layout
        cores = s_worker_cores(self.device.type == "cpu", self.args.pipeline_depth > 1,
                               rworkers_here=ranks_here - s_here)
        if self.device.type == "cpu":
            torch.set_num_threads(self.args.s_threads or cores)
        return cores

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
