"""End to end on one GPU box: S-worker on the GPU, R-workers on the box's cores, vs HF transformers.

Runs `mpirun -n 1+R fastdecode generate` on a random-weight model of a real shape (fewer layers,
as FastDecode's evaluation does; tokens/s scale by the layer ratio for both systems alike) for
each configuration (R-workers x threads, prompt length, batch), and HF transformers `generate`
on the same GPU with the same model at the largest batch that fits, in the same run. Reports
tokens/s, per-token latency, S- and R-time per step and which side bounds; the strong-scaling
efficiency over R (1 thread each) next to the machine's own bandwidth scaling.

    python3 bench/e2e/e2e_bench.py --label h100-box --model random:llama-2-7b:layers=4 \
        --runs 1x1 2x1 4x1 8x1 14x1 1x14 --prompt 1024 --gen 16 --batch 64 --hf
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed


def request_file(path, batch, prompt, gen):
    with open(path, "w") as f:
        for i in range(batch):
            ids = [100 + (i * 7 + j * 13) % 20000 for j in range(prompt)]
            body = {"prompt": ids, "max_tokens": gen, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n")


def run_ours(args, launcher, rworkers, threads, prompt, batch, tmp):
    inp = os.path.join(tmp, f"in_{prompt}_{batch}.jsonl")
    if not os.path.exists(inp):
        request_file(inp, batch, prompt, args.gen)
    tag = f"{rworkers}x{threads}_{prompt}_{batch}"
    out, stats = os.path.join(tmp, f"out_{tag}.jsonl"), os.path.join(tmp, f"stats_{tag}.json")
    cmd = launcher + ["-n", str(rworkers + 1), sys.executable, "-m", "fastdecode", "generate", "-m", args.model,
                      "-i", inp, "-o", out, "--quiet", "--overwrite", "--kv-dtype", "bf16", "--max-batch", str(batch),
                      "--max-prefill-tokens", str(args.prefill_tokens), "--r-threads", str(threads),
                      "--stats-json", stats] + shlex.split(args.extra)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=args.timeout)
    wall = time.perf_counter() - t
    if proc.returncode:
        return {"rworkers": rworkers, "threads": threads, "prompt": prompt, "error": proc.stderr[-1500:]}
    data = json.load(open(stats))
    s = data["summary"]
    dec = [x for x in data["steps"] if "s_time_s" in x and x["active"] == batch]
    step = sum(x["step_s"] - x["prefill_s"] for x in dec) / max(len(dec), 1)
    s_time = sum(x["s_time_s"] for x in dec) / max(len(dec), 1)
    r_time = sum(x.get("r_time_max_s", 0) for x in dec) / max(len(dec), 1)
    return {"rworkers": rworkers, "threads": threads, "prompt": prompt, "batch": batch, "gen": args.gen,
            "process_wall_s": round(wall, 2), "generate_wall_s": s["wall_s"],
            "decode_step_s": round(step, 5), "decode_tokens_per_s": round(batch / step, 2) if step else None,
            "output_tokens_per_s": s["output_tokens_per_s"], "token_latency_p50_s": s.get("token_latency_p50_s"),
            "s_time_per_step_s": round(s_time, 5), "r_attend_per_step_s": round(r_time, 5),
            "bound": "R" if r_time > s_time else "S", "s_bubble": s.get("s_bubble_fraction"),
            "r_bubble": s.get("r_bubble_fraction"), "prefill_s": round(sum(x["prefill_s"] for x in data["steps"]), 3)}


def run_hf(args, prompt):
    """HF generate, same shape and layer count, random bf16 weights, largest batch that fits."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastdecode.model.source import random_config_dict
    cfg = random_config_dict(args.model)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}, torch_dtype="bfloat16")
    dev = args.hf_device
    with torch.device(dev):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    free = torch.cuda.mem_get_info()[0] if dev == "cuda" else 8 << 30
    # KV for prompt + gen, and ~4x headroom for logits/activations of the prefill
    batch = int(free * 0.8 / (kv_per_token * (prompt + args.gen) + 4 * cfg["vocab_size"] * 4))
    batch = max(1, min(batch, args.hf_max_batch))
    result = None
    while batch >= 1:
        try:
            ids = torch.randint(100, 20000, (batch, prompt), device=dev)
            with torch.no_grad():
                model.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)
                sync()
                t = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.gen,
                                     min_new_tokens=args.gen, do_sample=False, pad_token_id=0)
                sync()
                wall = time.perf_counter() - t
            toks = (out.shape[1] - prompt) * batch
            result = {"system": "hf-transformers generate (bf16, KV on the GPU)", "prompt": prompt, "batch": batch,
                      "gen": args.gen, "wall_s": round(wall, 3), "output_tokens_per_s": round(toks / wall, 2)}
            break
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            batch = batch * 3 // 4
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default="random:llama-2-7b:layers=4")
    ap.add_argument("--launcher", default="mpirun --allow-run-as-root --oversubscribe --bind-to none")
    ap.add_argument("--runs", nargs="+", default=["1x1", "2x1", "4x1", "8x1", "14x1", "1x14"],
                    help="RxT: R R-workers with T threads each")
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024])
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=32768)
    ap.add_argument("--extra", default="", help="more generate flags")
    ap.add_argument("--hf", action="store_true", help="also run HF transformers on the GPU")
    ap.add_argument("--hf-max-batch", type=int, default=1024)
    ap.add_argument("--hf-device", default="cuda")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    launcher = shlex.split(args.launcher)
    tmp = tempfile.mkdtemp(prefix="e2e-")
    result = {"label": args.label, "model": args.model, "gen": args.gen, "batch": args.batch, "runs": [], "hf": []}
    path = args.out or os.path.join(RESULTS, f"e2e_{args.label}_{args.model.split(':')[1]}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for prompt in args.prompts:
        for spec in args.runs:
            r, t = (int(x) for x in spec.split("x"))
            row = run_ours(args, launcher, r, t, prompt, args.batch, tmp)
            result["runs"].append(row)
            print(row, flush=True)
            json.dump(result, open(path, "w"), indent=1)      # keep what is done if a later run is cut
        if args.hf:
            hf = run_hf(args, prompt)
            result["hf"].append(hf)
            print(hf, flush=True)
    single = {(x["prompt"]): x for x in result["runs"] if x.get("rworkers") == 1 and x.get("threads") == 1
              and "error" not in x}
    for x in result["runs"]:
        base = single.get(x["prompt"])
        if base and "error" not in x and x["threads"] == 1:
            x["scaling_efficiency_vs_1"] = round(x["decode_tokens_per_s"] / (x["rworkers"] * base["decode_tokens_per_s"]), 3)
        hf = next((h for h in result["hf"] if h and h["prompt"] == x["prompt"]), None)
        if hf and "error" not in x:
            x["vs_hf"] = round(x["output_tokens_per_s"] / hf["output_tokens_per_s"], 3)
    json.dump(result, open(path, "w"), indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
