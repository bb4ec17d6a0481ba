"""A tensor-parallel S-worker's request checked before anything loads (rank 0, before MPI starts:
the job ends with exit 2 naming what is wrong): enough ranks, one GPU per S-rank named by the
node's order (not by --device cuda:N), a model whose heads, KV heads and MLP widths split into T
equal parts (model/shard.py; the vocabulary is padded instead). The GPUs a node has are counted
once MPI is up (context.py), where each S-rank knows which of them share its node."""
from __future__ import annotations

from fastdecode.model.config import ModelConfig
from fastdecode.model.shard import split_error


def usage_error(size: int, config: ModelConfig, device: str, world: int) -> str | None:
    """Why `size` S-ranks cannot serve this job (None: they can). world: the job's MPI ranks."""
    if size == 1:
        return None
    if size > world:
        return (f"--tensor-parallel-size {size} needs {size} MPI ranks for the S-worker, and the job has {world}: "
                f"launch T+R ranks (mpirun -n {size + 1} for one R-worker; -n {size} for none)")
    if device.startswith("cuda:"):
        return (f"--device {device} names one GPU, and --tensor-parallel-size {size} puts each S-rank on its own: "
                f"give --device cuda (rank r takes the node's r-th GPU among its S-ranks; CUDA_VISIBLE_DEVICES "
                f"picks which)")
    return split_error(config, size)
