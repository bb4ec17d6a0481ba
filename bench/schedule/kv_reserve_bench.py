"""R-worker memory reservation: full worst-case (default) against grow-and-preempt, same run.

Chat questions with short answers, a generous max_tokens (what a user who does not know the answer
lengths sets) and sampled answers that end at EOS, on an R-worker memory budget that holds only a few worst
cases. Three runs of the same requests, in local mode:
- full: each sequence reserves prompt + max_tokens at admission (the peer);
- grow: page by page, preempting the youngest when a worker is full (their KV recomputed);
- oracle: full reservation with max_tokens set to each answer's real length (from the grow run;
  sampling is seeded per request, so the tokens are the same up to floating point): the batch a scheduler that knew
  the lengths could run, the limit for this budget.
Reports output tokens/s, mean decode batch, steps, preemptions and recomputed tokens, and checks
how many requests' outputs are identical between runs (the same up to floating point). Writes bench/schedule/results/kv_reserve_<label>.json.

    python3 bench/schedule/kv_reserve_bench.py --label devbox-2core
    python3 bench/schedule/kv_reserve_bench.py --label devbox-2core-preempt --instruction "Explain in detail." \
        --max-tokens 256 --mem 12M        # longer answers in less memory: grow must preempt
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed

from fastdecode import LLM, SamplingParams  # noqa: E402

QUESTIONS = ["What colour is the sky?", "What is the capital of France?", "How many legs does a spider have?",
             "What is 7 times 8?", "Name a primary colour.", "What gas do plants absorb?",
             "Which planet is closest to the Sun?", "What is the boiling point of water in Celsius?",
             "Who wrote Romeo and Juliet?", "What is the largest ocean?", "How many days are in a week?",
             "What is the opposite of hot?"]


def run(policy: str, messages, params, mem: int) -> dict:
    llm = LLM("smollm2-135m", device="cpu", kv_dtype="bf16", rworker_mem=mem, kv_reserve=policy)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    eng = llm.engine
    result = {"policy": policy, "wall_s": wall, "steps": eng.step_no, "output_tokens": eng.num_output_tokens,
              "output_tokens_per_s": eng.num_output_tokens / wall,
              "mean_decode_batch": eng.runner.decode_rows / max(eng.step_no, 1),
              "preemptions": eng.scheduler.num_preemptions, "recomputed_tokens": eng.num_recomputed_tokens,
              "capacity_tokens": eng.placement.total_capacity_tokens(),
              "tokens": [o.outputs[0].token_ids for o in outs]}
    llm.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--mem", default="24M", help="KV bytes of the (one, local) R-worker")
    ap.add_argument("--instruction", default="Answer briefly.", help="put before every question")
    args = ap.parse_args()
    from rworker.host.capacity import parse_bytes
    mem = parse_bytes(args.mem)
    messages = [[{"role": "user", "content": f"{args.instruction} {QUESTIONS[i % len(QUESTIONS)]}"}]
                for i in range(args.requests)]
    seeded = [SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i) for i in range(args.requests)]

    full = run("full", messages, seeded, mem)
    grow = run("grow", messages, seeded, mem)
    lengths = [len(t) for t in grow["tokens"]]
    exact = [SamplingParams(max_tokens=n, temperature=0.8, seed=i) for i, n in enumerate(lengths)]
    oracle = dict(run("full", messages, exact, mem), policy="oracle")
    # same seeds, so the same tokens up to floating point: PyTorch's CPU GEMM rounds a row differently
    # at a different row count, which can flip a sampled token at a near-tie
    same = {pair: sum(x == y for x, y in zip(a["tokens"], b["tokens"])) for pair, a, b in
            (("full_grow", full, grow), ("grow_oracle", grow, oracle))}
    for r in (full, grow, oracle):
        r.pop("tokens")
    result = {
        "label": args.label, "host": platform.node(), "model": "smollm2-135m", "kv_dtype": "bf16",
        "requests": args.requests, "max_tokens": args.max_tokens, "rworker_mem_bytes": mem,
        "instruction": args.instruction,
        "answer_lengths": {"mean": sum(lengths) / len(lengths), "max": max(lengths), "min": min(lengths)},
        "identical_outputs_of_requests": same, "full": full, "grow": grow, "oracle": oracle,
        "grow_vs_full_throughput": grow["output_tokens_per_s"] / full["output_tokens_per_s"],
        "grow_vs_oracle_throughput": grow["output_tokens_per_s"] / oracle["output_tokens_per_s"],
        "note": "local mode on this machine: S-part and R-part share its cores; oracle = full reservation of "
                "each answer's real length (the limit for this memory budget)",
    }
    out = os.path.join(RESULTS, f"kv_reserve_{args.label}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for r in (full, grow, oracle):
        print(f"{r['policy']:5s} {r['output_tokens_per_s']:7.1f} tok/s  batch {r['mean_decode_batch']:5.1f}  "
              f"steps {r['steps']:5d}  preemptions {r['preemptions']}  recomputed {r['recomputed_tokens']}")
    print(f"grow/full {result['grow_vs_full_throughput']:.2f}x, grow/oracle {result['grow_vs_oracle_throughput']:.2f}x, "
          f"identical outputs {same} of {args.requests} -> {out}")


if __name__ == "__main__":
    main()
