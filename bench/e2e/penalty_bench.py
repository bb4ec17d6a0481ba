"""Cost of the sampling penalties at batch scale, against the LM head they follow, same run.

B penalized rows, each with G generated and P prompt tokens (repetition, frequency and presence
penalties all on), vocabulary V: the host gathering of the histories (runner.penalties_of), the
sparse Penalties.apply (only the (row, token) pairs in the histories), a dense count-table
version of the same formula (the straightforward method, as the peer; its output must match),
and the LM-head GEMM [B, hidden] x [hidden, V] the logits come from. Best of --repeats each.
Writes bench/e2e/results/penalty_<label>.json.

    python3 bench/e2e/penalty_bench.py --label devbox-2core
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

from fastdecode.engine.runner import penalties_of  # noqa: E402
from fastdecode.engine.sampling_params import SamplingParams  # noqa: E402
from fastdecode.engine.sequence import Request, Sequence  # noqa: E402


def dense_apply(pen, logits: torch.Tensor) -> None:
    """The same formula with [rows, V] count and seen tables."""
    m, vocab = len(pen.rows), logits.shape[1]
    rows = torch.from_numpy(pen.rows)
    sub = logits[rows]
    counts = torch.zeros_like(sub)
    counts.index_put_((torch.from_numpy(pen.out_rows), torch.from_numpy(pen.out_ids)),
                      torch.ones(len(pen.out_ids)), accumulate=True)
    seen = counts > 0
    seen[torch.from_numpy(pen.seen_rows), torch.from_numpy(pen.seen_ids)] = True
    r = torch.from_numpy(pen.repetition)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - torch.from_numpy(pen.frequency)[:, None] * counts - torch.from_numpy(pen.presence)[:, None] * (counts > 0)
    logits[rows] = sub


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--generated", type=int, default=500)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)       # SmolLM2's
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.5, repetition_penalty=1.1)
    seqs = []
    for i in range(args.batch):
        req = Request(i, str(i), None, rng.integers(0, args.vocab, args.prompt).tolist(), params, 0)
        seq = Sequence(i, req, 0, args.generated + 1)
        seq.output_ids = rng.integers(0, args.vocab, args.generated).tolist()
        seqs.append(seq)
    rows = np.arange(args.batch)
    logits = torch.randn(args.batch, args.vocab)
    pen = penalties_of(seqs, rows)
    sparse, dense = logits.clone(), logits.clone()
    pen.apply(sparse)
    dense_apply(pen, dense)
    max_diff = float((sparse - dense).abs().max())
    assert max_diff < 1e-4, f"sparse and dense penalties differ by {max_diff}"
    h, w = torch.randn(args.batch, args.hidden), torch.randn(args.hidden, args.vocab)
    result = {
        "label": args.label, "host": platform.node(), "torch_threads": torch.get_num_threads(),
        "batch": args.batch, "generated": args.generated, "prompt": args.prompt, "vocab": args.vocab,
        "hidden": args.hidden, "max_abs_diff_sparse_vs_dense": max_diff,
        "gather_s": best(lambda: penalties_of(seqs, rows), args.repeats),
        "sparse_apply_s": best(lambda: pen.apply(logits.clone()), args.repeats),
        "dense_apply_s": best(lambda: dense_apply(pen, logits.clone()), args.repeats),
        "clone_s": best(lambda: logits.clone(), args.repeats),
        "lm_head_gemm_s": best(lambda: h @ w, args.repeats),
    }
    result["sparse_over_lm_head"] = round(result["sparse_apply_s"] / result["lm_head_gemm_s"], 3)
    result["dense_over_lm_head"] = round(result["dense_apply_s"] / result["lm_head_gemm_s"], 3)
    result["sparse_speedup_over_dense"] = round(result["dense_apply_s"] / result["sparse_apply_s"], 2)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"penalty_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
