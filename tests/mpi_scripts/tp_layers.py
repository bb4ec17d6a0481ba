"""Run under mpiexec -n T: every rank loads its shard of a model (model/shard.py) and runs the
S-part's prompt path over a packed batch (family_cases.prompt_logits: every layer's QKV, prompt
attention over its own heads, O and MLP with their all-reduces, the vocab-parallel LM head);
rank 0 writes the gathered logits, OUT_DIR/<model dir's name>[.fp8].pt per model.

usage: tp_layers.py OUT_DIR MODEL_DIR[:fp8] ...      (:fp8: --quantization fp8)
"""
import os
import sys

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from family_cases import LENGTHS, prompt_logits, prompts  # noqa: E402

from fastdecode.model.quantization import weight_format  # noqa: E402
from fastdecode.model.shard import Shard, local_config  # noqa: E402
from fastdecode.model.source import read_config, resolve_model  # noqa: E402
from fastdecode.model.spart import SPart  # noqa: E402
from fastdecode.model.weights import load_weights  # noqa: E402
from fastdecode.tp.group import TPGroup  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
group = TPGroup.start(comm, torch.device("cpu"), 60) if size > 1 else None
for arg in sys.argv[2:]:
    path, _, fp8 = arg.partition(":")
    source = resolve_model(path)
    config = read_config(source)
    weights = load_weights(source, config, torch.float32, "cpu", weight_format(fp8 or None, source),
                           Shard(rank, size) if size > 1 else None)
    m = SPart(local_config(config, size), weights, "cpu", torch.float32, tp=group, vocab_size=config.vocab_size)
    logits, _ = prompt_logits(m, prompts(LENGTHS))
    if rank == 0:
        torch.save(logits, os.path.join(sys.argv[1], os.path.basename(path) + (".fp8" if fp8 else "") + ".pt"))
if group is not None:
    group.close()
