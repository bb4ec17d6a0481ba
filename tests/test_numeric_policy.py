"""Numbers that change answers: one numeric policy for what the sampler's float32 can represent
(a temperature float32 rounds to 0 is greedy, a tiny one samples the greedy limit, a penalty it
cannot hold is refused), seeds in int64, fields the docs promise to refuse, and every duration and
size flag range-checked with the flag named."""
from __future__ import annotations

import argparse
import io
import math
from contextlib import redirect_stderr

import numpy as np
import pytest
import torch
from conftest import run_fastdecode

from fastdecode.batch.jsonl import parse_line
from fastdecode.engine.sampler import Penalties, SamplingBatch, sample
from fastdecode.engine.sampling_params import SamplingParams


def line(body: dict, url: str = "/v1/completions") -> str:
    import json
    return json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": {"prompt": "Hi", **body}})


def batch(temps: list[float]) -> SamplingBatch:
    rows = [(SamplingParams(temperature=t), 7, i, 0, None) for i, t in enumerate(temps)]
    return SamplingBatch(rows, "cpu")


@pytest.mark.parametrize("temperature", [1e-39, 1e-44, 1e-50, 1e-30])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    """1e-39 is a float32 subnormal: logits / T overflowed to inf and the softmax to NaN, and the
    sampler returned one garbage token; 1e-50 is 0 in float32 and was still "sampled"."""
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)) * 8          # [6, V]
    got = sample(logits, batch([temperature] * 6))
    assert got.tolist() == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=temperature).greedy == (np.float32(temperature) == 0)


def test_the_greedy_decision_and_the_division_use_the_same_float32():
    b = batch([0.0, 1e-50, 1e-39, 0.7])
    assert b.sample_rows.tolist() == [2, 3]            # 1e-50 rounds to 0 in float32: greedy
    assert b.temperature.dtype == torch.float32


def test_an_ordinary_temperature_still_samples():
    logits = torch.zeros(256, 50)                                         # [256, V]: uniform
    got = sample(logits, batch([1.0] * 256))
    assert len(set(got.tolist())) > 20


def test_a_penalty_past_float32_never_gives_nan():
    """repetition_penalty 1e-37 divides the seen tokens' logits past float32's range (inf): they
    are held at its largest value, so one of them is sampled, as the math says."""
    logits = torch.full((1, 100), -5.0)
    logits[0, [10, 20]] = 50.0
    b = batch([1.0])
    b.penalties = Penalties([0], [0.0], [0.0], [1e-37], [0, 0], [10, 20], [], [])
    assert sample(logits, b).tolist()[0] in (10, 20)


@pytest.mark.parametrize("value", [1e-300, 1e-39, 1e39, 0.0])
def test_a_repetition_penalty_float32_cannot_hold_is_a_400(value):
    row = parse_line(1, line({"repetition_penalty": value}))
    assert row.error is not None and row.error.status == 400
    assert "repetition_penalty must be a number > 0 that float32" in str(row.error), str(row.error)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=value)


def test_a_temperature_float32_turns_into_infinity_is_a_400():
    assert "temperature must be a finite number in [0, 3.403e+38]" in str(parse_line(1, line({"temperature": 1e39})).error)


@pytest.mark.parametrize("seed,ok", [(2**63, False), (-(2**63) - 1, False), (10**30, False), (2**63 - 1, True),
                                     (-(2**63), True)])
def test_a_seed_outside_int64_is_refused_as_vllm_does(seed, ok):
    row = parse_line(1, line({"seed": seed}))
    if ok:
        assert row.error is None and row.params.seed == seed
    else:
        assert row.error is not None and "seed must be an integer in [-2**63, 2**63 - 1]" in str(row.error)


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
                                         ("function_call", {"name": "f"}), ("tool_choice", "auto"),
                                         ("tool_choice", "required"), ("tool_choice", {"type": "function"})])
def test_function_and_tool_fields_are_unsupported_parameters(field, value):
    for url, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}), ("/v1/completions", {})):
        row = parse_line(1, line({**body, field: value}, url))
        assert row.error is not None and row.error.code == "unsupported_parameter", (url, row.error)
        assert f"body.{field}" in str(row.error)


def test_tool_choice_none_asks_for_a_plain_answer_and_is_served():
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert parse_line(1, line({**chat, "tool_choice": "none"}, "/v1/chat/completions")).error is None
    assert parse_line(1, line({**chat, "function_call": "none"}, "/v1/chat/completions")).error is None


def test_a_tiny_temperature_answers_as_greedy_end_to_end(llm):
    prompts = ["The capital of France is", "1, 2, 3,"]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    tiny = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1e-39, seed=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]


# ---------------------------------------------------------------------------- flags

def parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    from fastdecode.cli import build_parser
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            return build_parser().parse_args(argv), err.getvalue()
        except SystemExit as e:
            assert e.code == 2
            return None, err.getvalue()


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1e-9", "-inf", "1e12", "x"])
def test_a_timeout_that_is_no_duration_is_refused_naming_the_flag(value):
    args, err = parse(["generate", "-i", "in", "-o", "out", "--timeout", value])
    assert args is None and "argument --timeout: expected" in err, err


@pytest.mark.parametrize("value", ["0", "nan", "1e-9"])
def test_a_progress_interval_that_is_no_duration_is_refused(value):
    args, err = parse(["generate", "-i", "in", "-o", "out", "--progress-interval", value])
    assert args is None and "argument --progress-interval" in err, err


def test_good_durations_are_read():
    args, _ = parse(["generate", "-i", "in", "-o", "out", "--timeout", "5", "--progress-interval", "0.01"])
    assert args.timeout == 5.0 and args.progress_interval == 0.01


def test_a_size_flag_larger_than_the_machine_is_refused_naming_both():
    from fastdecode.flag_ranges import machine_error
    from fastdecode.launch.ranks import Roles
    args, _ = parse(["generate", "-i", "in", "-o", "out", "--rworker-mem", "100G"])
    total = 23 << 30
    assert machine_error(args, 0, Roles(1), total) == \
        "--rworker-mem 100.0 GiB is more than this machine's memory (23.0 GiB)"
    assert machine_error(args, 1, Roles(3), total) is not None       # an R-worker checks its own node
    assert machine_error(args, 0, Roles(3), total) is None           # rank 0 of an MPI job holds no KV
    assert machine_error(args, 1, Roles(3, 2), total) is None        # nor does a tensor-parallel S-rank
    assert machine_error(args, 2, Roles(3, 2), total) is not None
    assert machine_error(args, 0, Roles(2, 2), total) is not None    # T ranks alone: rank 0 holds it
    args, _ = parse(["generate", "-i", "in", "-o", "out", "--max-inflight-mem", "1T"])
    assert "--max-inflight-mem 1,024.0 GiB" in machine_error(args, 0, Roles(1), total)
    args, _ = parse(["generate", "-i", "in", "-o", "out"])
    assert machine_error(args, 0, Roles(1), 2 << 30) is None         # defaults are never refused


def test_the_roles_of_a_job_s_ranks():
    from fastdecode.launch.ranks import Roles
    plain, tp, alone, tp_alone = Roles(4), Roles(5, 2), Roles(1), Roles(2, 2)
    assert [plain.name(r) for r in range(4)] == ["S-worker", "R-worker", "R-worker", "R-worker"]
    assert [tp.name(r) for r in range(5)] == ["S-worker", "tensor-parallel S-rank"] + ["R-worker"] * 3
    assert list(plain.rworkers) == [1, 2, 3] and list(tp.rworkers) == [2, 3, 4]
    assert plain.kv_holders == 3 and tp.kv_holders == 3 and alone.kv_holders == 1 and tp_alone.kv_holders == 1
    assert [plain.holds_kv(r) for r in range(4)] == [False, True, True, True]
    assert [tp.holds_kv(r) for r in range(5)] == [False, False, True, True, True]
    assert alone.holds_kv(0) and [tp_alone.holds_kv(r) for r in range(2)] == [True, False]
    assert not tp_alone.rworkers


def test_role_names_follow_the_s_worker_s_ranks(monkeypatch):
    from fastdecode.launch import ranks
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setattr(ranks, "_s_ranks", 1)
    ranks.set_s_ranks(2)                    # what LLM(tensor_parallel_size=2) and the CLI both do first
    assert [ranks.role_name(r) for r in range(4)] == ["S-worker", "tensor-parallel S-rank", "R-worker", "R-worker"]


def test_bad_flags_exit_2_with_one_line_before_the_model_loads(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(line({}) + "\n")
    for flags, needle in ((["--timeout", "nan"], "argument --timeout"),
                          (["--rworker-mem", "64T"], "--rworker-mem 65,536.0 GiB is more than this machine's memory")):
        proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), *flags], timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("flag,value", [("cpu_eff", math.inf), ("cpu_bw", math.nan), ("link_bw", math.inf),
                                        ("link_latency", math.nan), ("rworker_overhead_us", math.inf)])
def test_plans_hardware_numbers_must_be_finite(flag, value):
    """--cpu-eff inf was a ZeroDivisionError; nan passed the checks of the latencies."""
    from fastdecode.sizing.plan import PlanError, check_hardware
    args = argparse.Namespace(cpu_bw=100.0, rworker_mem=None, link_bw=None, cpu_eff=0.66, link_latency=None,
                              rworker_overhead_us=None, shared_cost_ratio=None, device_kv=True,
                              device_kv_memory=None, device_kv_gbps=None)
    setattr(args, flag, value)
    with pytest.raises(PlanError, match=f"--{flag.replace('_', '-')} must be a finite number"):
        check_hardware(args)
