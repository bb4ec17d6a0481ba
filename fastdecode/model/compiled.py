"""The S-part's per-layer halves under torch.compile (Inductor) on a CPU S-worker.

Between two attentions a CPU S-worker runs a layer's dense half (O projection, residual, norm,
gate/up, activation, down, residual) and the next layer's QKV projection: a dozen ops, each
dispatched from Python and each a parallel region of its own. Compiled, the norms, activation and
residual adds fuse into a few loops around the GEMMs (which stay oneDNN/MKL calls) and run
without per-op dispatch.

One graph serves every layer: the layer's weights are inputs (SPart.layer_post_attn takes them
as a dict), not constants, and the row count is a dynamic dimension, so neither a layer nor a
new batch size recompiles. Inductor keeps what it generates in the fastdecode cache directory
(`inductor/` beside the model caches), so only the first job on a machine pays the compile; the
start-up line says which it was.

Opt-in (`--compile`): on the dev box (2 Zen 5 cores, bf16) the compiled halves ran slower than
eager ones, whose GEMMs already bound the step, and even a cached compile adds seconds to every
start (docs/results.md). What runs eagerly although asked, named on the start-up line: a GPU
S-worker (CUDA graphs serve it), a tensor-parallel rank (its all-reduces sit between the ops),
routed experts (rows picked at run time), fp8 weights, and any failure of the compile itself.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch


@dataclass
class CompiledLayers:
    qkv_proj: object            # (L, x [n, h]) -> qkv [n, (Hq + 2 Hkv) D]
    post_attn: object           # (L, x [n, h], o [n, Hq, D]) -> x [n, h]
    seconds: float              # the warm-up compile (or cache load) at start-up
    cached: bool                # Inductor found every graph in its cache


def why_eager(model) -> str | None:
    """Why `model` (an SPart) runs eagerly although --compile asked otherwise, or None."""
    if model.device.type != "cpu":
        return f"an S-worker on {model.device.type} (CUDA graphs serve it: --cuda-graphs)"
    if model.tp is not None:
        return "a tensor-parallel S-worker"
    if model.config.moe_layers:
        return "routed experts"
    if model.fp8:
        return "fp8 weights"
    return None


def inductor_cache_dir() -> str:
    """Where Inductor keeps its generated code: $TORCHINDUCTOR_CACHE_DIR if the user set one, else
    the fastdecode cache's inductor/ (shared by every job and rank on the machine)."""
    from fastdecode.model.source import cache_dir
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(cache_dir(), "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path        # read by Inductor when it first writes
    return path


def compile_layers(model) -> tuple[CompiledLayers | None, str]:
    """Compile `model`'s per-layer halves and run each once (the compile happens then, not in the
    first step). -> (the compiled halves, or None with the reason it runs eagerly; a start-up line)."""
    reason = why_eager(model)
    if reason is not None:
        return None, f"S-part eager ({reason})"
    cache = inductor_cache_dir()
    t0 = time.perf_counter()
    try:
        from torch._dynamo.utils import counters
        before = counters["inductor"]["fxgraph_cache_miss"]
        qkv = torch.compile(model.layer_qkv_proj, dynamic=True, fullgraph=True)
        post = torch.compile(model.layer_post_attn, dynamic=True, fullgraph=True)
        _warm_up(model, qkv, post)
        misses = counters["inductor"]["fxgraph_cache_miss"] - before
    except Exception as e:  # noqa: BLE001 - whatever the compiler trips on, eager still serves
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return None, f"S-part eager (torch.compile failed: {type(e).__name__}: {first})"
    seconds = time.perf_counter() - t0
    done = CompiledLayers(qkv, post, seconds, cached=misses == 0)
    how = "cached" if done.cached else "compiled"
    return done, f"S-part compiled (Inductor, {how} in {seconds:.1f} s; cache {cache})"


@torch.inference_mode()
def _warm_up(model, qkv, post) -> None:
    """One call of each on two rows of zeros, as the runner calls them (inference mode)."""
    c = model.config
    x = torch.zeros(2, c.hidden_size, dtype=model.residual_dtype, device=model.device)      # [2, h]
    o = torch.zeros(2, c.num_heads, c.head_dim, dtype=model.dtype, device=model.device)   # [2, Hq, D]
    L = model.layers[0]
    qkv(L, x)
    post(L, x, o)
