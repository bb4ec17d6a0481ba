"""Baseline end-to-end throughput: `fastdecode generate` vs HF transformers `generate`, same run.

64 prompts x 128 new tokens (greedy, EOS ignored so every system makes the same number of
tokens) on the default model. fastdecode runs in local mode and under mpiexec with 1 and 2
R-workers; HF transformers runs one batched `generate` (left padding) on the same weights.
Writes bench/e2e/results/generate_<label>.json.

    python3 bench/e2e/generate_bench.py [--label NAME] [--prompts 64] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed

TOPICS = ["the ocean", "a lighthouse", "mathematics", "a city at night", "coffee", "the moon", "trains",
          "a library", "mountains", "rain", "music", "a robot", "gardens", "winter", "friendship", "the desert"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "List facts about {}.",
         "Describe {} in detail."]


def prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[i % len(TOPICS)]) + f" (#{i})" for i in range(n)]


def batch_file(path: str, texts: list[str], new_tokens: int) -> None:
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            body = {"prompt": t, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n")


def run_fastdecode(inp: str, ranks: int | None, extra: list[str]) -> dict:
    out = tempfile.mktemp(suffix=".jsonl")
    stats = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out, "--quiet", "--overwrite",
           "--stats-json", stats] + extra
    if ranks:
        cmd = [shutil.which("mpiexec"), "-n", str(ranks)] + cmd
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    summary = json.load(open(stats))["summary"]
    with open(out) as f:
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in f)
    return {"ranks": ranks or 1, "rworkers": (ranks - 1) if ranks else "local", "process_wall_s": round(wall, 2),
            "generate_wall_s": summary["wall_s"], "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / summary["wall_s"], 2),
            "token_latency_p50_s": summary.get("token_latency_p50_s"),
            "throughput_line": proc.stdout.strip().splitlines()[-1]}


def run_hf(texts: list[str], new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastdecode.model.source import resolve_model
    src = resolve_model("smollm2-135m")
    d, f = os.path.dirname(src.path), os.path.basename(src.path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)  # warm-up
        t = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)
        wall = time.perf_counter() - t
    tokens = (out.shape[1] - enc["input_ids"].shape[1]) * len(texts)
    return {"system": "hf-transformers generate (fp32, one batch, KV on the host)", "wall_s": round(wall, 2),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2), "batch": len(texts)}


def warm_load_s() -> float:
    code = ("import time; t=time.perf_counter(); from fastdecode import LLM; "
            "llm=LLM('smollm2-135m'); print(time.perf_counter()-t)")
    subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=REPO, check=True)   # warms the cache
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return round(float(proc.stdout.strip().splitlines()[-1]), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default=platform.node() or "host")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    texts = prompts(args.prompts)
    inp = tempfile.mktemp(suffix=".jsonl")
    batch_file(inp, texts, args.new_tokens)
    engine = ["--dtype", "float32", "--kv-dtype", "fp32", "--max-batch", str(args.prompts)]   # as HF's peer
    result = {"label": args.label, "cpu": platform.processor(), "cores": os.cpu_count(),
              "prompts": args.prompts, "new_tokens": args.new_tokens, "model": "smollm2-135m (fp32 S-part, fp32 KV)",
              "warm_model_load_s": warm_load_s(), "runs": []}
    result["hf"] = run_hf(texts, args.new_tokens)
    for ranks in (None, 2, 3):
        r = run_fastdecode(inp, ranks, engine)
        r["vs_hf"] = round(r["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"], 3)
        result["runs"].append(r)
        print(r, flush=True)
    print(result["hf"], flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"generate_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
