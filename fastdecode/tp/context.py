"""Joining the tensor-parallel S-worker: what every S-rank does alike once rank 0 has said "start"
(steps.py): the S-ranks' own MPI communicator, this rank's GPU (its index among the S-ranks on its
node: one process per GPU), the torch.distributed group, its shard of the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdecode.model.config import ConfigError, ModelConfig
from fastdecode.model.shard import Shard, local_config
from fastdecode.tp.group import TPGroup


@dataclass
class TPContext:
    group: TPGroup
    shard: Shard
    config: ModelConfig            # this rank's slice: 1/T of the heads and MLP rows (model/shard.py)
    device: torch.device

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size


def s_ranks_comm(comm, size: int):
    """Collective over ranks 0..size-1 of `comm` only: their own communicator (rank r is world rank r)."""
    return comm.Create_group(comm.Get_group().Range_incl([(0, size - 1, 1)]))


def node_device(s_comm, asked: torch.device) -> torch.device:
    """This S-rank's device: on CUDA the GPU of its index among the S-ranks on its node (ConfigError
    where the node has fewer GPUs than S-ranks); a CPU stays the CPU."""
    if asked.type != "cuda":
        return asked
    from mpi4py import MPI
    local = s_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        index, here = local.Get_rank(), local.Get_size()
    finally:
        local.Free()
    gpus = torch.cuda.device_count()
    if here > gpus:
        import socket
        raise ConfigError(f"--tensor-parallel-size {s_comm.Get_size()} puts {here} S-ranks on {socket.gethostname()}, "
                          f"which has {gpus} GPU{'s' if gpus != 1 else ''}: one S-rank per GPU (launch fewer ranks "
                          f"there, or a smaller --tensor-parallel-size)")
    return torch.device("cuda", index)


def join(comm, size: int, config: ModelConfig, asked_device: torch.device, timeout_s: float | None) -> TPContext:
    """Collective over the S-ranks (after rank 0's "start"): communicator, device, group, shard."""
    s_comm = s_ranks_comm(comm, size)
    device = node_device(s_comm, asked_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup.start(s_comm, device, timeout_s)
    return TPContext(group, Shard(s_comm.Get_rank(), size), local_config(config, size), device)
