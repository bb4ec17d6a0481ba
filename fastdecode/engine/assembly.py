"""An S-worker rank assembled: the one path by which rank 0's engine (llm_engine.py) and every
tensor-parallel follower (tp/follower_engine.py) build what they both hold, in one order (the
order of their collectives: the node layout, the group's join, the tier's size, the R-part).

What is tensor-parallel comes from `parallel` (fastdecode/tp gives rank 0's and a follower's):
how the ranks join (-> the rank's context: device, group, shard, its config), how they reach the
R-workers (rank 0 gathers every rank's heads), and rank 0's start-up line. The engine never
imports tp; tp builds on the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from fastdecode.engine import rpart_setup, spart_setup
from fastdecode.engine.args import EngineArgs, resolve_batch_limits, resolve_device, resolve_dtypes, say_dtype
from fastdecode.engine.kv_tiers import TierChoice, choose_tier
from fastdecode.launch.ranks import Roles
from fastdecode.model.config import ModelConfig
from fastdecode.model.quantization import WeightFormat, say_fp8, weight_format
from fastdecode.model.source import ModelSource, read_config, resolve_model
from fastdecode.model.spart import SPart
from fastdecode.model.weights import load_weights
from fastdecode.rpart.base import RBackend
from rworker.host.wait import node_layout


class TensorParallel(Protocol):
    """A tensor-parallel S-worker's side of the assembly (tp/leader.py, tp/follower_engine.py)."""

    def join(self, comm, args: EngineArgs, config: ModelConfig): ...      # -> tp.context.TPContext

    def workers(self, parts: Parts, comm, others: RBackend | None) -> RBackend: ...

    def say(self, parts: Parts) -> None: ...


@dataclasses.dataclass
class Parts:
    """What an S-worker rank is made of (a follower's model and tier: its shard's)."""
    args: EngineArgs                  # with the batch limits resolved
    source: ModelSource
    config: ModelConfig               # the whole model's (a rank's own heads: model.config)
    max_model_len: int
    layout: tuple | None              # (ranks on this node, S-ranks among them, my index); None: alone
    tp: object | None                 # tp.context.TPContext, or None
    device: torch.device
    dtype: torch.dtype
    kv_dtype: str
    weight_format: WeightFormat
    kv_bytes_per_token: int
    s_cores: int
    node_cpus: list[int]
    tier: TierChoice
    model: SPart
    backend: RBackend | None = None
    variants: object = None           # rpart.variants.AttentionVariants of the model


def build(args: EngineArgs, comm=None, parallel: TensorParallel | None = None, layout: tuple | None = None,
          say: bool = True) -> Parts:
    """Assemble an S-worker rank. comm: the S-worker's communicator (its group's, with R-workers
    after its S-ranks; None: local mode); layout: the node layout where the caller took it already
    (a follower takes it before it learns whether to start); say: print the start-up lines (rank 0)."""
    source = resolve_model(args.model, args.revision)
    config = read_config(source)
    max_model_len = config.resolve_max_model_len(args.max_model_len)
    s_ranks = args.tensor_parallel_size
    if layout is None and comm is not None and comm.Get_size() > 1:
        layout = node_layout(comm, s_ranks)
    if s_ranks > 1 and parallel is None:
        raise ValueError(f"tensor_parallel_size={s_ranks}: the engine is made by fastdecode.tp (tp/engines.py)")
    # a tensor-parallel S-worker: ranks 0..T-1 join, each on its own GPU with 1/T of the model (fastdecode/tp/)
    tp = parallel.join(comm, args, config) if s_ranks > 1 else None
    device = tp.device if tp else resolve_device(args.device)
    dtype, kv_dtype = resolve_dtypes(args, device, config)
    quiet = args.quiet or not say
    if not quiet:
        say_dtype(args, device, config, dtype)
    fmt = weight_format(args.quantization, source)
    kv_bytes_per_token = config.kv_bytes_per_token(kv_dtype)
    one_node = tp is None and (layout is None or layout[0] == comm.Get_size())     # the R-part beside
    args = resolve_batch_limits(args, device, config, dtype, one_node)
    s_cores, node_cpus = spart_setup.setup_cores(args, device, layout, tp, say=not quiet)
    members = Roles(comm.Get_size(), s_ranks).members if comm is not None else 1
    tier = choose_tier(args.device_kv, args.device_kv_memory, device, kv_dtype, members,
                       layout[0] if layout else 1, kv_bytes_per_token)
    weights = load_weights(source, config, dtype, device, fmt, tp.shard if tp else None)
    model = SPart(tp.config if tp else config, weights, device, dtype, max_model_len=max_model_len,
                  tp=tp.group if tp else None, vocab_size=config.vocab_size)
    del weights
    parts = Parts(args, source, config, max_model_len, layout, tp, device, dtype, kv_dtype, fmt, kv_bytes_per_token,
                  s_cores, node_cpus, tier, model)
    if say:
        say_fp8(fmt, model)                   # even with --quiet: what fp8 does to the weights
    if tp is not None and not quiet:
        parallel.say(parts)
    parts.backend, parts.variants, parts.tier = rpart_setup.make_backend(parts, comm, parallel)
    return parts


def adopt(target, parts: Parts) -> None:
    """Give an engine object every part as an attribute of its own (eng.config, eng.backend, ...)."""
    for f in dataclasses.fields(parts):
        setattr(target, f.name, getattr(parts, f.name))
