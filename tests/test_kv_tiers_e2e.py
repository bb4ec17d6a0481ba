"""The S-worker's own KV tier through the whole engine, greedy against HF transformers (fp32):
the GPU's tier (torch pages; FASTDECODE_DEVICE_TIER=torch runs its code on this CPU) beside local
mode's store and beside 2 R-workers under mpiexec -n 3, and a CPU S-worker's in-process store
beside 2 R-workers. The R-side memory is kept small so that both tiers hold sequences (each run
checks it did), and one run under --kv-reserve grow preempts in both tiers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import MPIEXEC, REPO, hf_greedy
from test_hf_parity import ENGINE, GREEDY, SAMPLED, hf_reference  # noqa: F401  (the fixture)

SEQ_BYTES = 64 * 45 * 1024          # a sequence of these prompts + 40-48 tokens: 2 pages of 32, 45 KiB a token


def run(tmp_path, name, ranks, engine, torch_tier, requests=GREEDY + SAMPLED):
    req, out = tmp_path / f"{name}.req.json", tmp_path / f"{name}.out.json"
    req.write_text(json.dumps(requests))
    cmd = [sys.executable, os.path.join(REPO, "tests", "mpi_scripts", "generate_ids.py"), str(req), str(out),
           json.dumps({**ENGINE, **engine})]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FASTDECODE_DEVICE_TIER", None)
    if torch_tier:
        env["FASTDECODE_DEVICE_TIER"] = "torch"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


CASES = {
    # name: (ranks, engine kwargs, torch tier)
    # neither side has room for all 8 sequences, so both hold some however the speeds measure
    "local+gpu-tier": (None, {"rworker_mem": 3 * SEQ_BYTES, "device_kv_memory": 5 * SEQ_BYTES}, True),
    "n3+gpu-tier": (3, {"rworker_mem": 2 * SEQ_BYTES, "device_kv_memory": 5 * SEQ_BYTES}, True),
    "n3+cpu-tier": (3, {"rworker_mem": 2 * SEQ_BYTES, "device_kv_memory": 5 * SEQ_BYTES}, False),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiers")
    return {name: run(tmp, name, *case) for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_identical_to_hf_with_both_tiers_holding_sequences(runs, hf_reference, name):  # noqa: F811
    got = runs[name]
    ranks = CASES[name][0]
    assert got["workers"] == (ranks - 1 if ranks else 1) and len(got["tiers"]) == 1
    placed = got["placed"]
    assert placed[-1] > 0 and sum(placed[:-1]) > 0, f"both tiers should hold sequences: {placed}"
    for i, ref in enumerate(hf_reference):
        assert got["outputs"][i][0] == ref, f"{name}: prompt {i} differs from HF"


def test_sampling_the_same_whatever_the_tier(runs):
    n = len(GREEDY)
    first = runs["local+gpu-tier"]["outputs"][n:]
    for name in CASES:
        assert runs[name]["outputs"][n:] == first, name


def test_grow_preempts_in_both_tiers_and_matches_hf(tmp_path, hf_smollm):
    """--kv-reserve grow with 4 pages on each of 2 R-workers and the tier: each side starts two
    sequences (a page each, a page of headroom per resident), both grow to 3 pages (a prompt of
    about 20 tokens + 60), so every side preempts its youngest, and the recomputed sequences still
    give HF's greedy tokens."""
    tok, model = hf_smollm
    prompts = [f"Write the number {i} in words, then count down from {i + 5}:" for i in range(8)]
    ids = [tok(p)["input_ids"] for p in prompts]
    assert all(15 <= len(i) <= 30 for i in ids)
    reqs = [{"prompt_ids": i, "params": {"max_tokens": 60, "temperature": 0, "ignore_eos": True}} for i in ids]
    got = run(tmp_path, "grow", 3, {"rworker_mem": 2 * SEQ_BYTES, "device_kv_memory": 2 * SEQ_BYTES,
                                    "kv_reserve": "grow"}, True, reqs)
    tier = str(len(got["placed"]) - 1)
    assert got["preempted_on"].get(tier, 0) > 0, got["preempted_on"]
    assert all(got["preempted_on"].get(str(w), 0) > 0 for w in range(got["workers"])), got["preempted_on"]
    for i, p in enumerate(ids):
        never = [model.config.vocab_size + 1]                  # an EOS it never emits: all 60 tokens
        assert got["outputs"][i][0] == hf_greedy(model, p, 60, never), f"prompt {i} differs from HF"


@pytest.mark.parametrize("ranks", [None, 2], ids=["local+gpu-tier", "mpiexec-n2"])
def test_out_of_memory_mid_job_keeps_rows_and_resumes(tmp_path, ranks):
    """An allocation failing in step 8 (as a GPU's does: FASTDECODE_INJECT_FAULT's oom): one line
    saying where and what to lower, exit 1, the rows finished before it kept, and the rerun
    answers the rest."""
    from conftest import batch_line, read_output, run_fastdecode
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": 2 if i < 3 else 30,
                                                "temperature": 0, "ignore_eos": True}) + "\n" for i in range(6)))
    args = ["generate", "-i", str(inp), "-o", str(out), "--quiet", "--kv-dtype", "bf16"]
    env = {"FASTDECODE_DEVICE_TIER": "torch", "FASTDECODE_INJECT_FAULT": "0:step:oom:8"}
    proc = run_fastdecode(args, ranks=ranks, env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "ran out of memory in step 8" in proc.stderr and "rerun to resume" in proc.stderr
    kept = [r["custom_id"] for r in read_output(str(out))]
    assert sorted(kept) == ["r0", "r1", "r2"]                 # the short ones finished before step 8
    proc = run_fastdecode(args, ranks=ranks, env={"FASTDECODE_DEVICE_TIER": "torch"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(r["custom_id"] for r in read_output(str(out))) == [f"r{i}" for i in range(6)]
