"""GPU-only serving as the peer of a fastdecode cluster: HF transformers `generate` with the whole
model and its KV cache on one GPU, random bf16 weights of a published shape at full depth.

Per workload (prompt length, output length) the largest batch that fits the card (estimated from
free memory, halved on out-of-memory), timed twice in the same process:
- prefill: `generate(max_new_tokens=1)`, the prompt pass and one token;
- whole: `generate(max_new_tokens=gen, min_new_tokens=gen)`;
decode tokens/s = batch * (gen - 1) / (whole - prefill): the GPU-only decode rate the cluster
simulator's projections compare against (docs/projections.md). No download: the weights are random.

    python3 bench/gpu/gpu_only_bench.py --label h100-box --model random:llama-3-8b \
        --workloads 512,128 2048,128 32000,32                 # bench/gpu_box.sh gpuonly
    python3 bench/gpu/gpu_only_bench.py --label devbox --device cpu \
        --model random:llama-3-8b:layers=1:hidden=256:heads=4:kv_heads=2:intermediate=512:vocab=1000 \
        --workloads 64,8 --max-batch 8                        # a smoke run on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from fastdecode.model.source import random_config_dict  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def build_model(spec: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = random_config_dict(spec)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    return model, cfg


def batch_estimate(cfg: dict, prompt: int, gen: int, free_bytes: int, max_batch: int) -> int:
    """Sequences that fit: their KV (prompt + gen tokens, bf16) and the prefill's MLP activations."""
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    act_per_token = (3 * cfg["intermediate_size"] + 6 * cfg["hidden_size"]) * 2
    per_seq = kv_per_token * (prompt + gen) + act_per_token * prompt
    return max(1, min(max_batch, int(free_bytes * 0.85 / per_seq)))


def timed_generate(model, ids, new_tokens: int, cache: str, sync) -> float:
    """No attention mask (no padding): the causal SDPA path, no [B, H, S, S] mask materialized."""
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, cache_implementation=cache)
    sync()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - t


def run_workload(model, cfg, prompt: int, gen: int, cache: str, args, sync) -> dict:
    free = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 8 << 30
    batch = batch_estimate(cfg, prompt, gen, free, args.max_batch)
    while True:
        try:
            ids = torch.randint(1, min(20000, cfg["vocab_size"]), (batch, prompt), device=args.device)
            prefill_s = timed_generate(model, ids, 1, cache, sync)
            whole_s = timed_generate(model, ids, gen, cache, sync)
            break
        except torch.OutOfMemoryError:
            if batch == 1:
                return {"prompt": prompt, "gen": gen, "cache": cache, "error": "out of memory at batch 1"}
            batch = max(1, batch // 2)
            torch.cuda.empty_cache()
    decode_s = max(whole_s - prefill_s, 1e-9)
    return {"prompt": prompt, "gen": gen, "cache": cache, "batch": batch, "prefill_s": round(prefill_s, 3),
            "whole_s": round(whole_s, 3), "decode_s": round(decode_s, 3),
            "decode_tokens_per_s": round(batch * (gen - 1) / decode_s, 1),
            "output_tokens_per_s": round(batch * gen / whole_s, 1),
            "decode_step_s": round(decode_s / (gen - 1), 5)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workloads", nargs="+", default=["512,128", "2048,128", "32000,32"],
                    help="PROMPT,GEN pairs")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--caches", nargs="+", default=["dynamic", "static"], choices=("dynamic", "static"),
                    help="HF cache implementations: dynamic grows by concatenation, static is preallocated")
    args = ap.parse_args()
    import transformers

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()
    model, cfg = build_model(args.model, args.device)
    with torch.no_grad():   # warm-up: kernels, allocator
        model.generate(torch.randint(1, min(20000, cfg["vocab_size"]), (2, 16), device=args.device), max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    doc = {"label": args.label, "model": args.model, "device": device_name,
           "system": "hf-transformers generate, bf16, KV cache on the GPU (sdpa attention, no mask: causal kernel)",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "date": time.strftime("%Y-%m-%d"), "runs": []}
    path = os.path.join(RESULTS, f"gpu_only_{args.label}.json")
    for w in args.workloads:
        prompt, gen = (int(x) for x in w.split(","))
        for cache in args.caches:
            row = run_workload(model, cfg, prompt, gen, cache, args, sync)
            print(row, flush=True)
            doc["runs"].append(row)
            with open(path, "w") as f:   # after every run: a cut run keeps what it finished
                json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
