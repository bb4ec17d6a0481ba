"""Sizing a tensor-parallel and fp8 S-worker (fastdecode/sizing/tensor_parallel.py): weights per
GPU, the collectives' cost per layer, a measured profile scaled, plan's flags."""
import argparse
import json

import pytest

from fastdecode.sizing import plan
from fastdecode.sizing.hardware import GPU_PRESETS
from fastdecode.sizing.schema import MODEL_PRESETS, SWorkerProfile
from fastdecode.sizing.tensor_parallel import (
    TPSizing,
    add_options,
    allreduce_s,
    layer_comm_s,
    sizing_from_args,
    tensor_parallel_s_worker,
    weight_bytes_per_gpu,
)

L70 = MODEL_PRESETS["llama-3-70b"]
H100 = GPU_PRESETS["h100"]


def test_weights_per_gpu_halve_in_fp8_and_split_over_t():
    table = L70.vocab * L70.hidden * L70.dtype_bytes
    layers = L70.num_layers * L70.layer_weight_bytes()
    assert weight_bytes_per_gpu(L70, TPSizing(1, False)) == pytest.approx(layers + 2 * table)
    assert weight_bytes_per_gpu(L70, TPSizing(1, True)) == pytest.approx(layers / 2 + 2 * table)
    # 4 ranks: a quarter of the projections and of the LM head, the whole embedding on each
    assert weight_bytes_per_gpu(L70, TPSizing(4, True)) == pytest.approx(layers / 8 + table / 4 + table)
    # 70B in fp8 fits one 80 GB card's weights, in bf16 it does not
    assert weight_bytes_per_gpu(L70, TPSizing(1, True)) < 80e9 < weight_bytes_per_gpu(L70, TPSizing(1, False))


def test_allreduce_follows_the_ring_and_a_single_rank_has_none():
    t = TPSizing(4, allreduce_GBps=100.0, latency_us=10.0)
    assert allreduce_s(1e9, t) == pytest.approx(10e-6 + 2 * 3 / 4 * 1e9 / 100e9)
    assert allreduce_s(1e9, TPSizing(1)) == 0.0
    assert layer_comm_s(L70, 1024, TPSizing(1)) == 0.0
    # per layer: 2 all-reduces of rows x hidden, the Q/K/V gather and the O scatter at rank 0
    rows = 1024
    both = 2 * allreduce_s(rows * L70.hidden * L70.dtype_bytes, t)
    assert layer_comm_s(L70, rows, t) > both > 0


def measured(device="gpu:h100", quantization="") -> SWorkerProfile:
    return SWorkerProfile(device, [64, 1024], [2e-3, 4e-3], [1e-3, 2e-3], prefill_token_s=[1e-4],
                          quantization=quantization)


def test_a_measured_bf16_layer_is_split_over_t_and_sped_up_by_fp8_plus_the_collectives():
    t = TPSizing(2, True, fp8_speedup=2.0)
    s = tensor_parallel_s_worker(measured(), L70, t)
    for b, was, now in zip([64, 1024], [2e-3, 4e-3], s.layer_time_s):
        assert now == pytest.approx(was / 2 / 2 + layer_comm_s(L70, b, t))
    # measured in fp8 already: no second speed-up
    s8 = tensor_parallel_s_worker(measured(quantization="fp8"), L70, t)
    assert s8.layer_time_s[1] == pytest.approx(4e-3 / 2 + layer_comm_s(L70, 1024, t))


def test_a_slower_interconnect_costs_more_per_layer():
    fast = tensor_parallel_s_worker(measured(), L70, TPSizing(4, allreduce_GBps=360.0))
    slow = tensor_parallel_s_worker(measured(), L70, TPSizing(4, allreduce_GBps=25.0))
    assert slow.layer_time_s[1] > fast.layer_time_s[1]


def test_stated_fp8_on_a_card_without_fp8_gemms_is_slower_than_on_one_with_them():
    with_fp8 = tensor_parallel_s_worker(measured(), L70, TPSizing(1, True), H100)
    without = tensor_parallel_s_worker(measured(), L70, TPSizing(1, True), GPU_PRESETS["a100"])
    assert without.layer_time_s[-1] > with_fp8.layer_time_s[-1]


def test_a_tensor_parallel_size_below_one_is_refused_as_generate_refuses_it(capsys):
    p = argparse.ArgumentParser()
    add_options(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--tensor-parallel-size", "0"])
    assert "argument --tensor-parallel-size/-tp: expected a positive integer, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--tp-link-gbps", "0"], "--tp-link-gbps must be a finite number"),
])
def test_bad_flags_name_themselves(argv, needle):
    p = argparse.ArgumentParser()
    add_options(p)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        sizing_from_args(p.parse_args(argv))


STATED = ["--model", "llama-3-70b", "--gpu-profile", "h100", "--cpu-bw", "400", "--context", "4096",
          "--batch", "8192", "--json"]


def test_plan_70b_fp8_over_t_gpus(capsys):
    rows = {}
    for t in (1, 2, 4):
        assert plan.main([*STATED, "--quantization", "fp8", "--tensor-parallel-size", str(t)]) == 0
        rows[t] = json.loads(capsys.readouterr().out)
    assert plan.main(STATED) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert "fp8 weights" in rows[1]["s_worker"] and "4 GPUs" in rows[4]["s_worker"]
    # fp8 on one card runs the batch's layer faster than bf16 there; 4 ranks faster again
    assert rows[4]["s_layer_s"] < rows[1]["s_layer_s"] < bf16["s_layer_s"]


def test_profile_refuses_a_tensor_parallel_s_worker_pointing_at_plan(tmp_path):
    from conftest import run_fastdecode
    proc = run_fastdecode(["profile", "-o", str(tmp_path / "p.json"), "--tensor-parallel-size", "3"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "fastdecode profile measures one S-rank, not --tensor-parallel-size 3" in proc.stderr
    assert "`fastdecode plan --tensor-parallel-size 3`" in proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_simulate_runs_70b_faster_in_fp8_over_two_gpus(capsys):
    from fastdecode.cli import main
    job = ["simulate", "--model", "llama-3-70b", "--gpu-profile", "h100", "--cpu-bw", "400", "--requests", "64",
           "--prompt-len", "128", "--output-len", "64", "--rworkers", "2", "--json", "--no-numba"]
    runs = {}
    for name, extra in (("bf16", []), ("fp8x2", ["--quantization", "fp8", "--tensor-parallel-size", "2"])):
        assert main([*job, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["fp8x2"]["output_tokens"] == runs["bf16"]["output_tokens"] == 64 * 64
    assert runs["fp8x2"]["output_tokens_per_s"] > runs["bf16"]["output_tokens_per_s"]
