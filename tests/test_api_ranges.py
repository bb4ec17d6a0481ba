"""The Python API takes the values the command line takes: `LLM(**kwargs)` refuses, before any model
loads, what generate's flags refuse (flag_ranges.ENGINE_RANGES), with a ValueError naming the
argument and the flag; a timeout below a second would make every rank "silent" and exit 75 on every
requeue, a batch of 0 or 2.5 sequences or a size past the machine's memory is no job at all."""
from __future__ import annotations

import dataclasses

import pytest

from fastdecode import LLM
from fastdecode.cli import build_parser
from fastdecode.engine.args import EngineArgs
from fastdecode.flag_ranges import ENGINE_RANGES, engine_args_error

REFUSED = [  # (LLM keyword arguments, the flag and its value on the command line, what the error names)
    ({"timeout": -1}, ["--timeout", "-1"], "timeout=-1: expected seconds in [1, "),
    ({"timeout": 0.001}, ["--timeout", "0.001"], "timeout=0.001: expected seconds in [1, "),
    ({"timeout": float("inf")}, ["--timeout", "inf"], "as --timeout takes"),
    ({"seed": "x"}, ["--seed", "x"], "seed='x': expected an integer, as --seed takes"),
    ({"max_num_seqs": 0}, ["--max-num-seqs", "0"], "max_batch=0: expected a positive integer, as --max-batch"),
    ({"max_num_seqs": 2.5}, ["--max-num-seqs", "2.5"], "max_batch=2.5: expected an integer"),
    ({"max_logprobs": -1}, ["--max-logprobs", "-1"], "max_logprobs=-1: expected a positive integer"),
    ({"pipeline_depth": 10**6}, ["--pipeline-depth", "1000000"], "pipeline_depth=1000000: expected at most"),
    ({"gpu_memory_utilization": 1.5}, ["--gpu-memory-utilization", "1.5"], "expected a fraction in (0, 1]"),
    ({"rworker_mem": 1 << 50}, ["--rworker-mem", "1024T"], "--rworker-mem 1,048,576.0 GiB is more than this "
                                                            "machine's memory"),
]


@pytest.mark.parametrize("kwargs, flag, message", REFUSED, ids=[str(k) for k, _, _ in REFUSED])
def test_the_api_refuses_what_the_command_line_refuses(kwargs, flag, message, capsys):
    with pytest.raises(ValueError) as e:
        LLM("smollm2-135m", device="cpu", **kwargs)        # refused before the model loads
    assert message in str(e.value) and "\n" not in str(e.value)
    if flag[0] == "--rworker-mem":        # a size is read by argparse, then checked on the rank that holds it
        return
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "-i", "in.jsonl", "-o", "out.jsonl", *flag])
    assert exit_.value.code == 2


def test_every_range_is_a_field_and_a_generate_flag_and_defaults_are_in_range():
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    known = set(build_parser().commands["generate"].option_names())
    for field, flag, _, _ in ENGINE_RANGES:
        assert field in fields and flag in known, (field, flag)
    assert engine_args_error(EngineArgs()) is None
    assert engine_args_error(EngineArgs(timeout=1, seed=-5, max_batch=1, gpu_memory_utilization=1)) is None
