"""fp8 KV is not served, and no command pretends it is: generate (its --kv-dtype and vLLM's
kv_cache_dtype), plan, simulate and the Python API accept the same KV dtypes, and refuse fp8 with
one message naming int8 as the way to halve KV bytes."""
from __future__ import annotations

import pytest

from fastdecode import LLM
from fastdecode.cli import main
from fastdecode.engine.args import EngineArgs, resolve_dtypes
from rworker.protocol.kvformat import KV_DTYPES

STATED = ["--model", "smollm2-135m", "--gpu-profile", "h100", "--cpu-bw", "20"]
PLAN = ["plan", *STATED, "--batch", "64"]
SIMULATE = ["simulate", *STATED, "--rworkers", "1", "--max-batch", "64", "--requests", "20", "--output-len", "16"]
HALVES = "fp8 KV is not served by fastdecode"


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "-i", "in.jsonl", "-o", "out.jsonl"], PLAN, SIMULATE,
                                     ["profile", "--quick"]])
def test_every_command_refuses_fp8_kv_with_one_message_naming_int8(command, capsys):
    err = usage_error([*command, "--kv-dtype", "fp8"], capsys)
    assert HALVES in err and "--kv-dtype int8" in err and "halves bf16's KV bytes" in err
    assert f"KV dtype 'fp8_e5m2': {HALVES}" in usage_error([*command, "--kv-dtype", "fp8_e5m2"], capsys)
    assert "expected auto or one of fp32, bf16, fp16, int8, got 'fp4'" in usage_error([*command, "--kv-dtype", "fp4"],
                                                                                       capsys)


def test_the_api_refuses_fp8_kv_with_the_same_message():
    for kwargs in ({"kv_dtype": "fp8"}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}):
        with pytest.raises(ValueError, match=f"{HALVES}.*int8"):
            LLM("smollm2-135m", device="cpu", **kwargs)
    with pytest.raises(ValueError, match=HALVES):
        resolve_dtypes(EngineArgs(kv_dtype="fp8"), __import__("torch").device("cpu"))


def test_plan_and_simulate_take_the_dtypes_generate_takes(capsys):
    for kv in ("auto", *KV_DTYPES):
        assert main([*PLAN, "--kv-dtype", kv]) == 0
        assert main([*SIMULATE, "--kv-dtype", kv]) == 0
    out = capsys.readouterr().out
    assert "B/elem" in out
