"""Does prefill cost per prompt token separate into (prompt length) + (chunk size)? The profile
used to assume so (fastdecode/sizing/measure.py). Times measure.time_prefill for each prompt length at
1 .. N prompts per chunk (local mode, one process, --rounds interleaved passes) and writes
bench/sizing/results/prefill_chunk_<label>.json: ms per prompt token, per round.

    python3 bench/sizing/prefill_chunk_probe.py --label devbox-2core-kvheavy \
        --model random:smollm2-135m:layers=12:hidden=256:heads=16:kv_heads=16:intermediate=512:vocab=4096
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--prompts", default="512:1,2,4,16;768:1,2,4,10;1024:1,2,4,8",
                    help="PROMPT_LEN:COUNTS;... (counts of prompts per chunk)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from fastdecode.engine.args import EngineArgs
    from fastdecode.engine.llm_engine import LLMEngine
    from fastdecode.sizing import measure

    plan = [(int(p), [int(c) for c in counts.split(",")])
            for p, counts in (item.split(":") for item in args.prompts.split(";"))]
    cap = max(p * max(counts) for p, counts in plan)
    engine = LLMEngine(EngineArgs(model=args.model, kv_dtype=args.kv_dtype, max_prefill_tokens=cap), None)
    ms = {f"{p}x{c}": [] for p, counts in plan for c in counts}
    for _ in range(args.rounds):
        for p, counts in plan:
            for c in counts:
                ms[f"{p}x{c}"].append(round(measure.time_prefill(engine, p, c * p) * 1e3, 4))
            print(p, {c: ms[f"{p}x{c}"][-1] for c in counts}, flush=True)
    engine.close()
    result = {"label": args.label, "host": platform.node(), "model": args.model, "kv_dtype": args.kv_dtype,
              "unit": "ms per prompt token", "key": "PROMPT_LENxPROMPTS_PER_CHUNK", "ms": ms}
    path = os.path.join(RESULTS, f"prefill_chunk_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
