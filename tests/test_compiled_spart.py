"""--compile: a CPU S-part's per-layer halves under torch.compile (fastdecode/model/compiled.py)
give the eager path's greedy tokens in float32, fall back to eager with one line naming why when
the compiler fails, and stay eager where they cannot compile (named)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastdecode import LLM, SamplingParams
from fastdecode.model import compiled

SMALL = "random:llama-3-8b:layers=3:hidden=256:heads=8:kv_heads=2:head_dim=32:intermediate=512:vocab=1000"
PROMPTS = [[1, 2, 3, i] for i in range(6)] + [[7] * 40]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_compiled_layers_give_the_eager_tokens_in_float32(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))          # a cold Inductor cache of its own
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")              # unset (restored after the test)
    eager = tokens(LLM(SMALL, dtype="float32", quiet=True))
    llm = LLM(SMALL, dtype="float32", compile=True)
    err = capfd.readouterr().err
    assert llm.engine.model.compiled is not None, err
    assert "S-part compiled (Inductor, compiled in" in err and str(tmp_path / "inductor") in err, err
    assert tokens(llm) == eager
    assert any((tmp_path / "inductor").iterdir())                 # the generated code kept for the next job


def test_a_failing_compiler_leaves_the_eager_path_with_one_line(monkeypatch, capfd):
    def refuse(*a, **k):
        raise RuntimeError("no C++ compiler found\nsecond line of the report")
    monkeypatch.setattr(torch, "compile", refuse)
    llm = LLM(SMALL, dtype="float32", compile=True)
    err = capfd.readouterr().err
    assert "fastdecode: S-part eager (torch.compile failed: RuntimeError: no C++ compiler found)" in err, err
    assert "second line" not in err and "Traceback" not in err
    assert llm.engine.model.compiled is None
    assert tokens(llm) == tokens(LLM(SMALL, dtype="float32", quiet=True))


@pytest.mark.parametrize("change, reason", [
    (dict(device=torch.device("cuda")), "an S-worker on cuda"),
    (dict(tp=object()), "a tensor-parallel S-worker"),
    (dict(moe=(0,)), "routed experts"),
    (dict(fp8=True), "fp8 weights"),
])
def test_what_cannot_compile_is_named(change, reason):
    model = SimpleNamespace(device=change.get("device", torch.device("cpu")), tp=change.get("tp"),
                            config=SimpleNamespace(moe_layers=change.get("moe", ())), fp8=change.get("fp8", False))
    assert compiled.why_eager(model).startswith(reason)
    done, line = compiled.compile_layers(model)
    assert done is None and line == f"S-part eager ({compiled.why_eager(model)})"


def test_enforce_eager_contradicts_compile():
    with pytest.raises(ValueError, match="enforce_eager contradicts compile"):
        LLM(SMALL, compile=True, enforce_eager=True)
