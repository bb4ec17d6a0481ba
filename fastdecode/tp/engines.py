"""The S-worker's engine as every door makes it (the CLI, LLM(...), a data-parallel group,
profile): tensor-parallel where the arguments say so, rank 0's side of the assembly then coming
from here (leader.py), since the engine itself never imports tp/."""
from __future__ import annotations

from fastdecode.engine.args import EngineArgs
from fastdecode.engine.llm_engine import LLMEngine
from fastdecode.tp.leader import Leader


def s_worker_engine(args: EngineArgs, comm=None) -> LLMEngine:
    """Rank 0's engine on `comm` (its S-worker's ranks first, then its R-workers; None: local mode)."""
    return LLMEngine(args, comm, Leader if args.tensor_parallel_size > 1 else None)
