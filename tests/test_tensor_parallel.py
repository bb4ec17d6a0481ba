"""The tensor-parallel S-worker (`--tensor-parallel-size T`, fastdecode/tp/) on CPUs over gloo:
its layers against T = 1 and HF transformers (a tiny Llama with Q/K/V/O biases and a vocabulary
T does not divide, a tiny Qwen2-MoE with a shared expert, the Llama in fp8 quantized at load and
as a published fp8 checkpoint); the whole engine at T = 2 and T = 3 giving T = 1's greedy tokens
with the S-worker's own KV tier holding sequences on every S-rank beside an R-worker; the bad
inputs; a follower killed mid-job."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import MPIEXEC, REPO, read_output, run_fastdecode
from family_cases import LENGTHS, build_hf, prompt_logits, prompts, save_tokenizer
from test_fp8_checkpoints import fp8_checkpoint
from test_hf_parity import GREEDY

from fastdecode.model.config import ConfigError
from fastdecode.model.quantization import weight_format
from fastdecode.model.shard import Shard, local_config, split_error
from fastdecode.model.source import read_config, resolve_model
from fastdecode.model.spart import SPart
from fastdecode.model.weights import load_weights
from fastdecode.tp.checks import usage_error

PARITY_RTOL = 1e-4             # as test_families_spart: max |ours - HF| against HF's logit scale
TP_RTOL = 2e-5                 # T = 2 against T = 1: the same products summed in another order
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
ENGINE = {"kv_dtype": "fp32", "dtype": "float32", "device": "cpu"}
# a tensor-parallel S-worker on CPU ranks (gloo) is a test vehicle for the GPU one: float32, since three
# ranks on two cores in the CPU default, bf16, crawled (a 16-line job past 10 minutes)
CPU_TP = ["--dtype", "float32"]


def build_llama(root, name: str, vocab: int):
    """A tiny Llama (8 query / 2 KV heads of 32, Q/K/V and O biases) saved under root/name."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                                   head_dim=32, intermediate_size=192, num_hidden_layers=3,
                                   max_position_embeddings=256, attention_bias=True, initializer_range=0.1,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(root / name)
    return str(root / name), model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    llama, hf_llama = build_llama(root, "llama", vocab=509)        # 509 rows: padded to 510 at T = 2
    moe, hf_moe = build_hf("qwen2_moe", root)
    ckpt = fp8_checkpoint(llama, root / "llama-ct", "compressed-tensors")
    return {"llama": (llama, hf_llama), "qwen2_moe": (moe, hf_moe), "llama-ct": (ckpt, None)}


def one_rank(path: str, fp8: bool = False) -> torch.Tensor:
    source = resolve_model(path)
    config = read_config(source)
    w = load_weights(source, config, torch.float32, "cpu", weight_format("fp8" if fp8 else None, source))
    return prompt_logits(SPart(config, w, "cpu", torch.float32), prompts(LENGTHS))[0]


@pytest.fixture(scope="module")
def two_ranks(models, tmp_path_factory):
    """Each model's logits from 2 S-ranks (one mpiexec run for all)."""
    out = tmp_path_factory.mktemp("tp-out")
    args = [models["llama"][0], models["llama"][0] + ":fp8", models["qwen2_moe"][0], models["llama-ct"][0] + ":fp8"]
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, os.path.join(REPO, "tests", "mpi_scripts",
                                                                            "tp_layers.py"), str(out)] + args,
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: torch.load(out / f"{name}.pt") for name in ("llama", "llama.fp8", "qwen2_moe", "llama-ct.fp8")}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / float(b.abs().max())


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_layers_at_two_ranks_equal_one_rank_and_hf(models, two_ranks, name):
    path, hf = models[name]
    one, two = one_rank(path), two_ranks[name]
    assert two.shape == one.shape == (sum(LENGTHS), read_config(resolve_model(path)).vocab_size)
    assert max_rel(two, one) <= TP_RTOL
    start = 0
    for p in prompts(LENGTHS):
        with torch.no_grad():
            ref = hf(p[None]).logits[0]                                  # [n, V]
        assert max_rel(two[start:start + len(p)], ref) <= PARITY_RTOL
        assert torch.equal(two[start:start + len(p)].argmax(-1), ref.argmax(-1))
        start += len(p)


@pytest.mark.parametrize("name", ["llama.fp8", "llama-ct.fp8"])
def test_fp8_layers_at_two_ranks_equal_one_rank(models, two_ranks, name):
    """fp8 quantized at load (row-parallel weights quantized whole, then cut: the same scales) and a
    published compressed-tensors checkpoint (column-parallel scales cut with their rows)."""
    one = one_rank(models[name.split(".")[0]][0], fp8=True)
    assert max_rel(two_ranks[name], one) <= TP_RTOL


def test_a_rank_holds_its_share():
    """Rank 1 of 2 of the tiny MoE's shapes: half the heads and expert rows, the LM head's rows padded."""
    from fastdecode.model.config import ModelConfig
    c = ModelConfig("llama", 2, 64, 8, 2, 8, 96, 11, 1e-6, 1e4, 64, False)
    lc = local_config(c, 2)
    assert (lc.num_heads, lc.num_kv_heads, lc.intermediate_size, lc.vocab_size) == (4, 1, 48, 11)
    assert Shard(1, 2).vocab_rows(11) == (6, 11, 6)
    assert split_error(c, 3) is not None and "8 query heads and 2 KV heads" in split_error(c, 3)
    with pytest.raises(ConfigError):
        local_config(c, 4 * 3)


# ---------------------------------------------------------------------------- the whole engine

def engine_run(tmp_path, name: str, requests: list, engine: dict, ranks: int | None) -> dict:
    req, out = tmp_path / f"{name}.req.json", tmp_path / f"{name}.out.json"
    req.write_text(json.dumps(requests))
    cmd = [sys.executable, os.path.join(REPO, "tests", "mpi_scripts", "generate_ids.py"), str(req), str(out),
           json.dumps({**ENGINE, **engine})]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(ENV, FASTDECODE_DEVICE_TIER="torch"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_engine_model(tmp_path_factory):
    path, _ = build_llama(tmp_path_factory.mktemp("tp-engine"), "llama", vocab=512)
    save_tokenizer(path)
    return path


def tiny_requests() -> list:
    """Greedy prompts of 20-45 tokens, three of them sharing a 64-token prefix (forked on their
    worker, the S-worker's tier included), one asking for prompt and output log-probabilities."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (20, 31, 45, 27, 38, 24)]
    prefix = torch.randint(3, 512, (64,), generator=g).tolist()
    ids += [prefix + torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 12)]
    reqs = [{"prompt_ids": i, "params": {"max_tokens": 14, "temperature": 0, "ignore_eos": True}} for i in ids]
    reqs[1]["params"].update(prompt_logprobs=2, logprobs=2)
    return reqs


def test_two_ranks_serve_t1s_greedy_tokens_with_the_tier_on_every_rank(tmp_path, tiny_engine_model):
    """T = 2 (mpiexec -n 3: 2 S-ranks + 1 R-worker) and T = 1 (local mode), chunked prefill on,
    the device tier small enough (and the R-worker's memory) that both hold sequences."""
    token = 3 * 2 * 2 * 32 * 4                        # fp32 K and V of a token over the 3 layers (1.5 KiB)
    kw = {"model": tiny_engine_model, "max_batch": 6, "max_num_batched_tokens": 40, "rworker_mem": 3 * 128 * token}
    one = engine_run(tmp_path, "t1", tiny_requests(), {**kw, "device_kv_memory": 5 * 128 * token}, None)
    two = engine_run(tmp_path, "t2", tiny_requests(),
                     {**kw, "tensor_parallel_size": 2, "device_kv_memory": 5 * 128 * token // 2}, 3)
    assert two["workers"] == 1 and len(two["tiers"]) == 1
    assert two["placed"][-1] > 0 and sum(two["placed"][:-1]) > 0, two["placed"]
    assert two["prefix"]["prefix_hits"] > 0, two["prefix"]
    assert two["outputs"] == one["outputs"]
    for a, b in zip(two["prompt_logprobs"][1], one["prompt_logprobs"][1]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_three_ranks_serve_the_embedded_models_greedy_tokens(tmp_path):
    """smollm2-135m has 9 query and 3 KV heads: T = 3 (mpiexec -n 4: 3 S-ranks + 1 R-worker) gives
    T = 1's greedy tokens (mpiexec -n 2; HF's, test_hf_parity), both tiers holding sequences."""
    seq = 64 * 45 * 1024                           # a sequence of these prompts: 2 pages of 45 KiB a token
    reqs = [dict(r, params={**r["params"], "max_tokens": 16}) for r in GREEDY]
    one = engine_run(tmp_path, "t1", reqs, {"rworker_mem": 2 * seq, "device_kv_memory": 2 * seq}, 2)
    three = engine_run(tmp_path, "t3", reqs, {"tensor_parallel_size": 3, "rworker_mem": 2 * seq,
                                               "device_kv_memory": 2 * seq // 3}, 4)
    assert three["placed"][-1] > 0 and sum(three["placed"][:-1]) > 0, three["placed"]
    assert three["outputs"] == one["outputs"]


# ---------------------------------------------------------------------------- bad input, faults

@pytest.mark.parametrize("size, device, world, needle", [
    (2, "auto", 3, "must divide the model's 9 query heads and 3 KV heads"),
    (3, "auto", 2, "--tensor-parallel-size 3 needs 3 MPI ranks for the S-worker, and the job has 2"),
    (3, "cuda:1", 4, "--device cuda:1 names one GPU"),
])
def test_bad_sizes_are_refused_naming_both(size, device, world, needle):
    config = read_config(resolve_model("smollm2-135m"))
    assert needle in usage_error(size, config, device, world)
    assert usage_error(3, config, "auto", 4) is None


def test_an_intermediate_size_that_does_not_split_is_refused():
    config = read_config(resolve_model("smollm2-135m"))            # intermediate 1536 = 2^9 * 3
    import dataclasses
    odd = dataclasses.replace(config, num_heads=8, num_kv_heads=8, intermediate_size=1537)
    assert "intermediate_size 1537" in usage_error(2, odd, "auto", 3)


def test_heads_t_does_not_divide_end_the_job_before_the_weights_load(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "Hi", "max_tokens": 2}}) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--tensor-parallel-size", "2",
                           "--device", "cpu", *CPU_TP], ranks=3, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--tensor-parallel-size 2 must divide the model's 9 query heads and 3 KV heads" in proc.stderr
    assert "R-worker pid" not in proc.stderr           # no R-worker started its kernel tune


def test_a_killed_follower_ends_the_job_naming_it_and_the_rerun_resumes(tmp_path, tiny_engine_model):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    g = torch.Generator().manual_seed(5)
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": torch.randint(3, 512, (12,), generator=g).tolist(),
                                                "max_tokens": 3 + 3 * i, "temperature": 0, "ignore_eos": True}})
                           + "\n" for i in range(8)))
    args = ["generate", "-i", str(inp), "-o", str(out), "-m", tiny_engine_model, "--tensor-parallel-size", "2",
            "--device", "cpu", "--max-batch", "2", "--timeout", "10", "--quiet"]
    proc = run_fastdecode(args, ranks=3, timeout=300, env={"FASTDECODE_INJECT_FAULT": "1:step:kill:14"})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "rank 1 (tensor-parallel S-rank pid" in proc.stderr and "killed by SIGKILL" in proc.stderr, \
        proc.stderr[-2000:]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["failed_rank"] == 1, report
    kept = read_output(str(out))
    assert kept and all(r["response"]["status_code"] == 200 for r in kept)
    again = run_fastdecode(args, ranks=3, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = read_output(str(out))
    assert sorted(r["custom_id"] for r in rows) == [f"r{i}" for i in range(8)]
    assert all(r in rows for r in kept)                 # the first run's rows stay as they were


def test_s_ranks_starting_together_dequantize_a_gguf_once(tmp_path, monkeypatch):
    """The S-ranks load at once: one of them makes the GGUF's cache, the others wait and read it
    (each would otherwise hold the whole dequantized model in memory)."""
    import threading
    import time
    import types

    import numpy as np

    from fastdecode.model import weights
    made = []

    def slow_convert(path, config):
        made.append(path)
        time.sleep(0.3)                                # long enough for the other ranks to arrive
        return {"w": np.zeros(4, dtype=np.float32)}

    cache = tmp_path / "weights" / "m" / "model.safetensors"
    monkeypatch.setattr(weights, "gguf_cache_path", lambda source: str(cache))
    monkeypatch.setattr(weights, "_gguf_to_hf_arrays", slow_convert)
    source = types.SimpleNamespace(path="model.gguf")
    paths = []
    ranks = [threading.Thread(target=lambda: paths.append(weights._ensure_gguf_cache(source, None)))
             for _ in range(3)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join()
    assert made == ["model.gguf"] and paths == [str(cache)] * 3 and cache.is_file()


def test_a_stopped_follower_ends_the_job_within_the_timeout_naming_it(tmp_path):
    """SIGSTOP of rank 2 (a tensor-parallel S-rank) mid-job, --timeout 10: rank 0 names it from the
    followers' heartbeats (rank 1, blocked on it too, still beats) and the job ends soon after
    10 s, not at the followers' 30 s, with exit 75 and failed_rank 2; the rerun resumes."""
    import signal

    import psutil
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": f"Count to {i}:", "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True}}) + "\n" for i in range(16)))
    args = ["generate", "-i", str(inp), "-o", str(out), "--tensor-parallel-size", "3", "--device", "cpu", *CPU_TP,
            "--max-batch", "2", "--timeout", "10", "--quiet"]
    job = subprocess.Popen([MPIEXEC, "-n", "3", sys.executable, "-m", "fastdecode"] + args, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    stopped = None
    try:
        deadline = time.time() + 300
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.time() < deadline:
            time.sleep(0.2)
        for p in psutil.Process(job.pid).children(recursive=True):
            env = p.environ()
            if env.get("PMI_RANK") == "2" and env.get("FASTDECODE_SUPERVISED"):
                stopped = p
        assert stopped is not None, "rank 2's process not found"
        stopped.send_signal(signal.SIGSTOP)
        t0 = time.time()
        _, err = job.communicate(timeout=120)
        took = time.time() - t0
    finally:
        if stopped is not None:
            stopped.kill()
        if job.poll() is None:
            job.kill()
    assert job.returncode == 75, (job.returncode, err[-2000:])
    assert took < 20, f"the job took {took:.0f} s to end after its follower stopped (--timeout 10)"
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["failed_rank"] == 2, report
    assert "rank 2 (tensor-parallel S-rank on" in report["error"], report
    kept = read_output(str(out))
    again = run_fastdecode(args, ranks=3, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = read_output(str(out))
    assert sorted(r["custom_id"] for r in rows) == sorted(f"r{i}" for i in range(16)) and all(r in rows for r in kept)
