"""The CUDA S-worker, where a GPU is present (CI has none; run on the GPU box).

The MPI transport moves Q/K/V to pinned host buffers and O back on two side streams with
event waits, and the fused kernels write the wire layout directly. A missing wait or a buffer
reused too early shows as different tokens, so: the same requests in local mode (R-part
in-process, no copies on side streams) and under mpiexec with one and two R-workers must give
the same tokens, bit for bit, at the same pipeline depth (same mini-batches, so the same GEMM
shapes and the same kernels on every row).
"""
from __future__ import annotations

import random

import pytest
import torch
from test_hf_parity import run_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the transport's test: every sequence on the R-workers (or local mode's store), none on the card's tier
ENGINE = {"model": "random:llama-3-8b:layers=3", "device": "cuda", "dtype": "bfloat16", "kv_dtype": "bf16",
          "pipeline_depth": 2, "max_batch": 96, "device_kv": False}


def requests(n=96, seed=0):
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(100, 20000) for _ in range(rng.randrange(4, 300))],
             "params": {"max_tokens": rng.randrange(4, 24), "temperature": 0, "ignore_eos": True}}
            for _ in range(n)]


def test_transport_matches_local_mode(tmp_path, monkeypatch):
    import test_hf_parity
    monkeypatch.setattr(test_hf_parity, "ENGINE", ENGINE)
    reqs = requests()
    local = run_ids(tmp_path, reqs, None)
    assert local["workers"] == 1
    lengths = [len(o[0]) for o in local["outputs"]]
    assert lengths == [r["params"]["max_tokens"] for r in reqs]
    for ranks in (2, 3):
        got = run_ids(tmp_path, reqs, ranks)
        assert got["workers"] == ranks - 1
        same = sum(a == b for a, b in zip(got["outputs"], local["outputs"]))
        assert same == len(reqs), f"mpiexec -n {ranks}: {len(reqs) - same} of {len(reqs)} requests differ from local mode"


# ----------------------------------------------------------------------------- the card's own KV tier

@pytest.mark.parametrize("case", ["gemma2", "qwen3"])
def test_device_tier_on_the_card_matches_hf(case):
    """Every sequence in the card's tier (the host store gets 1 byte): the Triton paged kernel's
    windows, soft-caps and GQA through the whole engine, fp32, against HF on the same weights."""
    import test_families_variants_e2e as fam
    from fastdecode import LLM, SamplingParams
    root = __import__("tempfile").mkdtemp(prefix="tier-cuda-")
    path, hf = fam.build_hf(case, __import__("pathlib").Path(root), **fam.CASES[case])
    fam.save_tokenizer(path)
    ids = [p.tolist() for p in fam.prompts(fam.LENGTHS.get(case, [23, 40, 9]), seed=5)]
    refs = [fam.reference(hf, p) for p in ids]
    llm = LLM(path, **{**fam.ENGINE, "device": "cuda", "rworker_mem": 1})
    try:
        assert llm.engine.backend.workers[-1].tier.startswith("device (cuda")
        outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                            SamplingParams(max_tokens=fam.STEPS, temperature=0, ignore_eos=True, logprobs=fam.TOP),
                            use_tqdm=False)
        assert llm.engine.placement.placed[-1] == len(ids)
    finally:
        llm.close()
    fam.check(case, [o.outputs[0].token_ids for o in outs],
              [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs], refs)
