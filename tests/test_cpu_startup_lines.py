"""The start-up lines of a CPU S-worker's engine: the dtype `auto` chose and why (each CPU kind
forced through the ISA probe), and the S-part's torch threads."""
from __future__ import annotations

import pytest
import torch

import rworker.isa
from fastdecode import LLM

ZEN4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16"})
HASWELL = frozenset({"avx2", "fma", "f16c"})
TINY = "random:smollm2-135m:layers=1:vocab=500"


@pytest.mark.parametrize("features, line", [
    (ZEN4, "fastdecode: dtype bfloat16 (auto: the checkpoint's half precision, and this CPU computes bf16 "
           "(AVX512-BF16); --dtype float32 matches HF transformers' float32 outputs)"),
    (HASWELL, "fastdecode: dtype float32 (auto: this CPU lacks AVX512-BF16 and AMX, where bfloat16 runs slower "
              "than float32)"),
])
def test_the_start_up_line_says_the_dtype_and_why(monkeypatch, capfd, features, line):
    monkeypatch.setattr(rworker.isa, "cpu_features", lambda: features)
    llm = LLM(TINY, device="cpu")
    assert line in capfd.readouterr().err.splitlines()
    assert llm.engine.dtype == (torch.bfloat16 if features is ZEN4 else torch.float32)


def test_the_start_up_line_names_the_s_part_threads(capfd):
    LLM(TINY, device="cpu", s_threads=1)
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("fastdecode: S-part threads: ")]
    assert lines and lines[0].startswith("fastdecode: S-part threads: 1, "), lines
