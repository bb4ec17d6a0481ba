"""A CPU S-worker's defaults: --dtype auto (the checkpoint's dtype where the CPU computes bf16,
float32 elsewhere, chosen through the ISA probe), and how its torch threads' binding is said.
The start-up lines themselves, from a real engine: test_cpu_startup_lines.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rworker.isa
from fastdecode.engine.args import EngineArgs, auto_dtype, checkpoint_dtype, resolve_dtypes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ZEN4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16"})
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16"}
SKYLAKE_X = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
HASWELL = frozenset({"avx2", "fma", "f16c"})


def config(**hf) -> SimpleNamespace:
    return SimpleNamespace(hf_config=hf)


@pytest.mark.parametrize("features, dtype", [(ZEN4, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16),
                                             (SKYLAKE_X, torch.float32), (HASWELL, torch.float32),
                                             (frozenset(), torch.float32)])
def test_auto_is_bf16_only_on_cpus_that_compute_it(features, dtype):
    got, why = auto_dtype(CPU, "bfloat16", features)
    assert got == dtype
    assert ("AVX512-BF16" in why) if dtype == torch.bfloat16 else ("lacks AVX512-BF16 and AMX" in why)


def test_auto_keeps_a_float32_checkpoint_and_a_gpu_computes_bf16():
    assert auto_dtype(CPU, "float32", ZEN4) == (torch.float32, "the checkpoint stores float32")
    assert auto_dtype(CPU, None, ZEN4)[0] == torch.bfloat16            # GGUF, random: no dtype named
    assert auto_dtype(CUDA, "float32", HASWELL)[0] == torch.bfloat16   # the GPU default as before


def test_the_checkpoint_dtype_is_read_under_both_names():
    assert checkpoint_dtype(config(torch_dtype="float32")) == "float32"
    assert checkpoint_dtype(config(dtype="bfloat16")) == "bfloat16"          # transformers v5
    assert checkpoint_dtype(config(torch_dtype="torch.float16")) == "float16"
    assert checkpoint_dtype(config()) is None and checkpoint_dtype(None) is None


def test_the_probe_decides_and_the_kv_dtype_follows(monkeypatch):
    monkeypatch.setattr(rworker.isa, "cpu_features", lambda: SKYLAKE_X)
    assert resolve_dtypes(EngineArgs(), CPU, config(torch_dtype="bfloat16")) == (torch.float32, "fp32")
    monkeypatch.setattr(rworker.isa, "cpu_features", lambda: ZEN4)
    assert resolve_dtypes(EngineArgs(), CPU, config(torch_dtype="bfloat16")) == (torch.bfloat16, "bf16")
    assert resolve_dtypes(EngineArgs(), CPU, config(torch_dtype="float32")) == (torch.float32, "fp32")
    assert resolve_dtypes(EngineArgs(dtype="float32"), CPU, config()) == (torch.float32, "fp32")


def test_an_install_that_cannot_read_the_cpu_takes_float32(monkeypatch):
    def missing():
        raise ImportError("rworker kernel module 'portable' is not built")
    monkeypatch.setattr(rworker.isa, "cpu_features", missing)
    dtype, why = auto_dtype(CPU, "bfloat16")
    assert dtype == torch.float32 and "cannot read the CPU's features" in why


# ---------------------------------------------------------------------------- torch threads' binding

def test_the_binding_of_torch_threads_is_said_as_found():
    from fastdecode.launch.omp_binding import binding
    assert binding({}) == "unbound (OMP_PROC_BIND/OMP_PLACES unset)"
    assert binding({"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}) == \
        "bound (OMP_PROC_BIND=close, OMP_PLACES=cores)"
    assert binding({"OMP_PROC_BIND": "spread", "OMP_PLACES": ""}) == "bound (OMP_PROC_BIND=spread)"
