"""A CPU S-worker's defaults: --dtype auto (the checkpoint's dtype where the CPU computes bf16,
float32 elsewhere, chosen through the ISA probe), the pipeline depth (S and R taking turns where
they share a node), the prefill step's size, libgomp's spin, and how its torch threads' binding is said.
The start-up lines themselves, from a real engine: test_cpu_startup_lines.py."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import rworker.isa
from fastdecode.engine.args import (EngineArgs, auto_dtype, auto_pipeline_depth, checkpoint_dtype,
                                    resolve_batch_limits, resolve_dtypes)
from fastdecode.model.config import config_from_hf_dict
from fastdecode.model.source import random_config_dict

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


# ---------------------------------------------------------------------------- pipeline depth

def test_s_and_r_take_turns_only_where_a_cpu_s_worker_shares_its_node_with_the_r_part():
    assert auto_pipeline_depth(CPU, one_node=True) == 1          # local mode, or two ranks on one node
    assert auto_pipeline_depth(CPU, one_node=False) == 2         # R-workers on other nodes: overlap them
    assert auto_pipeline_depth(CUDA, one_node=True) == 2         # a GPU overlaps the host's attention


def test_the_depth_is_filled_in_once_and_a_given_one_is_kept():
    tiny = config_from_hf_dict(random_config_dict("random:smollm2-135m:layers=1"), "random")
    assert EngineArgs().pipeline_depth is None
    assert resolve_batch_limits(EngineArgs(), CPU, tiny, torch.float32, one_node=True).pipeline_depth == 1
    assert resolve_batch_limits(EngineArgs(), CPU, tiny, torch.float32).pipeline_depth == 2
    assert resolve_batch_limits(EngineArgs(pipeline_depth=2), CPU, tiny, torch.float32, True).pipeline_depth == 2
    with pytest.raises(ValueError, match="pipeline_depth must be in 1..64, got 0"):
        resolve_batch_limits(EngineArgs(pipeline_depth=0), CPU, tiny, torch.float32)


def test_a_cpu_prefill_step_holds_about_16_mib_of_activations_unless_told():
    """The embedded model's shape in bf16: (6 * 576 + 3 * 1536) * 2 bytes a token -> 1,040 tokens;
    float32 half that; a large model's shape stops at 256, a tiny one at 8,192; a given value stays."""
    def tokens(hidden, inter, dtype, given=None):
        cfg = config_from_hf_dict(random_config_dict("random:smollm2-135m:layers=1"), "random")
        cfg = dataclasses.replace(cfg, hidden_size=hidden, intermediate_size=inter)
        return resolve_batch_limits(EngineArgs(max_prefill_tokens=given), CPU, cfg, dtype).max_prefill_tokens
    assert tokens(576, 1536, torch.bfloat16) == (16 << 20) // ((6 * 576 + 3 * 1536) * 2) == 1040
    assert tokens(576, 1536, torch.float32) == 520
    assert tokens(8192, 28672, torch.bfloat16) == 256
    assert tokens(64, 128, torch.bfloat16) == 8192
    assert tokens(576, 1536, torch.bfloat16, given=4096) == 4096


# ---------------------------------------------------------------------------- libgomp's spin

def spin_in_a_child(code: str, **env) -> str:
    child_env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


SAY = "import os; from fastdecode.launch.omp_binding import spin; print(os.environ.get('GOMP_SPINCOUNT'), '|', spin())"


def test_fastdecode_shortens_libgomps_spin_before_torch_loads_unless_told():
    assert spin_in_a_child("import fastdecode; " + SAY) == "2000 | GOMP_SPINCOUNT=2000 (fastdecode's default)"
    assert spin_in_a_child("import fastdecode; " + SAY, GOMP_SPINCOUNT="50000") == "50000 | GOMP_SPINCOUNT=50000"


def test_torch_loaded_first_keeps_libgomps_spin_and_the_line_says_how_to_set_it():
    said = spin_in_a_child("import torch; import fastdecode; " + SAY)
    assert said.startswith("None | libgomp's default spin") and "export GOMP_SPINCOUNT=2000" in said
