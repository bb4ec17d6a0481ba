"""Cost of prompt log-probabilities (vLLM's `prompt_logprobs`, completions' `echo` with `logprobs`)
against the prefill they ride on and the LM-head GEMM they need, same run.

N prompts of L random tokens, max_tokens 1 (a scoring job: prefill and one token), through
`LLM.generate` in local mode: without prompt logprobs (the peer), with k = 0 and with k = 5; and
the LM-head GEMM alone over the same N x L rows (the work prompt logprobs cannot avoid: a
[N*L, hidden] x [hidden, V] product). Best of --repeats each, the variants interleaved.
Writes bench/e2e/results/prompt_logprobs_<label>.json.

    python3 bench/e2e/prompt_logprobs_bench.py --label devbox-2core
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed

from fastdecode import LLM, SamplingParams  # noqa: E402
from fastdecode.engine.runner import PROMPT_LOGPROB_BLOCK  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(args.model, device="cpu")
    cfg, model = llm.engine.config, llm.engine.model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.prompts)]
    variants = {"none": None, "k0": 0, "k5": 5}

    def job(k):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k), use_tqdm=False)
        wall = time.perf_counter() - t
        assert all((o.prompt_logprobs is None) == (k is None) for o in outs)
        return wall

    rows = args.prompts * args.prompt_len
    x = torch.randn(rows, cfg.hidden_size, dtype=model.dtype)                 # [N*L, h]
    block = max(1, PROMPT_LOGPROB_BLOCK // cfg.vocab_size)

    @torch.inference_mode()
    def gemm():
        t = time.perf_counter()
        for i in range(0, rows, block):
            model.logits(x[i: i + block])
        return time.perf_counter() - t

    job(None)                                                            # warm-up
    times = {name: [] for name in [*variants, "lm_head_gemm"]}
    for _ in range(args.repeats):
        for name, k in variants.items():
            times[name].append(job(k))
        times["lm_head_gemm"].append(gemm())
    llm.close()
    best = {name: min(t) for name, t in times.items()}
    base, head = best["none"], best["lm_head_gemm"]
    result = {
        "label": args.label, "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "model": args.model, "dtype": str(model.dtype),
        "prompts": args.prompts, "prompt_len": args.prompt_len, "prompt_tokens": rows,
        "vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "block_rows": block, "repeats": args.repeats,
        "seconds": times, "best_s": best,
        "extra_vs_prefill_job": {n: best[n] / base - 1 for n in ("k0", "k5")},
        "extra_vs_lm_head_gemm": {n: (best[n] - base) / head for n in ("k0", "k5")},
        "lm_head_gemm_vs_prefill_job": head / base,
        "note": "prefill job = LLM.generate(max_tokens=1) over the prompts, tokenization excluded (token-id "
                "prompts); extra = (time with prompt logprobs - time without); the GEMM is the floor of that extra",
    }
    out = os.path.join(RESULTS, f"prompt_logprobs_{args.label}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for n in ("k0", "k5"):
        print(f"prompt_logprobs={n[1:]}: job +{result['extra_vs_prefill_job'][n]:.1%}, "
              f"extra = {result['extra_vs_lm_head_gemm'][n]:.2f}x the LM-head GEMM")
    print(f"LM-head GEMM alone = {head / base:.2f}x the job without prompt logprobs ({base:.2f} s) -> {out}")


if __name__ == "__main__":
    main()
