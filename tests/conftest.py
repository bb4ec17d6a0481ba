"""Shared fixtures: the embedded model, an HF transformers reference on the same weights, and a
helper that runs `fastdecode` under `mpiexec` (the tests launch MPI themselves)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the launcher installed beside this Python (pip's MPICH, matching mpi4py) before any on PATH: the
# SLURM test setup also brings Debian's Open MPI into /usr/bin
_BESIDE = os.path.join(os.path.dirname(sys.executable), "mpiexec")
MPIEXEC = _BESIDE if os.access(_BESIDE, os.X_OK) else (shutil.which("mpiexec") or shutil.which("mpirun"))


def pytest_configure(config):
    # Keep the test machine's cache separate from the user's, but shared by all tests of a run.
    os.environ.setdefault("FASTDECODE_CACHE", os.path.join(REPO, ".pytest_cache", "fastdecode-cache"))
    # Engines and R-workers start without the kernel tune (seconds each, a ~1 GB probe): every
    # layout gives the same bits (test_kvstore); tests/test_kernel_tune.py turns it on.
    os.environ.setdefault("FASTDECODE_KERNEL_TUNE", "0")


@pytest.fixture(scope="module")
def llm():
    """The embedded model in fp32 with fp32 KV on the CPU, local mode: comparable with HF's fp32."""
    from fastdecode import LLM
    engine = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smollm_source():
    from fastdecode.model.source import resolve_model
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm(smollm_source):
    """HF transformers' own GGUF loader (its own dequantization and un-permutation): the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(smollm_source.path), os.path.basename(smollm_source.path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return tok, model


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """HF generate, batch of one (no padding), greedy; the new tokens (EOS included if hit)."""
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                             pad_token_id=list(eos_ids)[0])
    return out[0, len(ids):].tolist()


def batch_line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def read_output(path: str) -> dict[str, dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return rows


def run_fastdecode(args: list[str], ranks: int | None = None, timeout: float = 600,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """`fastdecode ...` as a singleton (ranks=None) or under `mpiexec -n ranks`."""
    cmd = [sys.executable, "-m", "fastdecode"] + args
    if ranks is not None:
        if MPIEXEC is None:
            pytest.fail("mpiexec not found: install it with `pip install mpich` (the multi-rank tests need it)")
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
