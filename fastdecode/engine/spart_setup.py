"""The S-worker's machine set-up: the cores and threads it computes with, and how its dense layers
run (replayed from CUDA graphs, compiled with Inductor on a CPU, or eagerly). Each function returns
what it decides; the engine keeps it."""
from __future__ import annotations

import os
import sys

import torch

from fastdecode.model.compiled import compile_layers
from fastdecode.model.layer_graphs import LayerGraphs


def setup_cores(args, device: torch.device, layout: tuple | None, tp, say: bool = True) -> tuple[int, list[int]]:
    """Threads and cores of the S-worker -> (the cores it keeps from co-located R-workers, the
    node's CPUs where it bound itself to its share of them, else []).

    MPI launchers make torch/MKL default to 1 thread (MPI_LOCALNRANKS), so set it always."""
    from rworker.host.cores import bind, launcher_bound, s_worker_cores
    node_cpus: list[int] = []
    pipelined = args.pipeline_depth > 1
    cpu = device.type == "cpu"
    if layout is None:                       # local mode: the R-part runs in this process
        s_cores = s_worker_cores(cpu, pipelined, rworkers_here=1)
    else:
        ranks_here, s_here, _ = layout
        s_cores = s_worker_cores(cpu, pipelined, rworkers_here=ranks_here - s_here)
        if ranks_here > 1 and pipelined and not launcher_bound() and tp is None:
            from rworker.host.threads import cpu_set, physical_cpus
            if hasattr(os, "sched_setaffinity"):
                node_cpus = cpu_set()
            bind(physical_cpus()[:s_cores])
    if cpu:
        torch.set_num_threads(args.s_threads or s_cores)
        if say and not args.quiet:
            from fastdecode.launch.omp_binding import binding, spin
            print(f"fastdecode: S-part threads: {torch.get_num_threads()}, {binding()}, {spin()}", file=sys.stderr,
                  flush=True)
    return s_cores, node_cpus


def prefills_on_the_node(args, device: torch.device, layout: tuple | None, node_cpus: list[int]) -> bool:
    """The R-part only appends during prefill (and attends a mixed step's few decode rows), so a CPU
    S-worker prefills on every core of its node: local mode's, or those it left to co-located
    R-workers (unless --s-threads fixed its threads)."""
    return device.type == "cpu" and not args.s_threads and (layout is None or bool(node_cpus))


def node_cores(node_cpus: list[int]) -> tuple[int, list[int]]:
    """(threads, CPUs) of a prefill on the node: its physical cores (node_cpus: the node's CPUs
    where the S-worker bound itself to a share of them, else [] for its own set)."""
    from rworker.host.threads import physical_cpus
    return len(physical_cpus(node_cpus or None)), node_cpus


def make_graphs(args, device: torch.device, model, tp) -> LayerGraphs | None:
    """CUDA graphs of the dense work between attentions where asked for and possible."""
    if not args.cuda_graphs or tp is not None:         # (a tensor-parallel S-worker runs eagerly)
        return None
    if device.type != "cuda":
        print(f"fastdecode: --cuda-graphs needs a CUDA S-worker (this one runs on {device}); "
              "running without graphs", file=sys.stderr, flush=True)
        return None
    return LayerGraphs(model, args.cuda_graph_max_rows)


def pack_weights(args, model) -> None:
    """The dense projections in oneDNN's layout where that pays (model/packed.py): a CPU S-part in
    bf16 running eagerly (--compile's graphs take the dense weights)."""
    from fastdecode.model import packed
    why = "--compile" if args.compile else packed.why_not(model)
    if why is None:
        nbytes = packed.pack(model)
        line = f"S-part weights prepacked for oneDNN ({nbytes / 2**20:.0f} MiB, the LM head's copy included)"
    else:
        line = f"S-part weights dense ({why})"
    if not args.quiet and model.device.type == "cpu":
        print(f"fastdecode: {line}", file=sys.stderr, flush=True)


def compile_spart(args, model) -> None:
    """Under --compile, the S-part's per-layer halves compiled (model/compiled.py); the start-up line
    says whether they were and, compiled, the seconds it took or that the cache served it."""
    if not args.compile:
        return
    model.compiled, line = compile_layers(model)
    if not args.quiet:
        print(f"fastdecode: {line}", file=sys.stderr, flush=True)
