"""Long prompts end to end: `fastdecode generate` against HF transformers `generate`, and prefill
against the same run's pure S-part prefill, with the prefill phases of every run.

Workload `long`: 32 prompts of 1,100 tokens x 64 new tokens (greedy, EOS ignored so every system
makes the same tokens). Workload `mixed`: 32 prompts of 100..4,000 tokens, 16..256 new tokens
each, unchunked against `--max-num-batched-tokens` chunks (local mode; and under mpiexec -n 2). Prompts are windows of the same token
stream (the docstrings of Python's standard library, tokenized once), given as token ids so
every system reads exactly the same prompt.

Peers and limits measured in the same run:
- HF transformers `generate` on the same weights (fp32, one left-padded batch, KV on the host),
  timed as a user waits for it: a fresh process that imports, loads and generates;
- the S-part alone: fastdecode's own dense layers and prompt attention over the same prompts in
  the same prefill batches, on every core, with no R-part and no wire (prefill's limit here).

    python3 bench/e2e/prefill_bench.py [--label NAME] [--workload long|mixed|both] [--skip-hf]

On a GPU box (the S-part alone is then its dense layers and flash attention on the GPU):
    prefill_bench.py --label h100-box --workload long --model random:llama-2-7b:layers=4 \
        --prompts 64 --prompt-len 1024 --new-tokens 16 --ranks 2,9 --launcher "mpirun ..." \
        --device cuda --dtype bfloat16 --skip-hf

Writes bench/e2e/results/prefill_<label>.json (and .png with matplotlib).
"""
from __future__ import annotations

import argparse
import inspect
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
MODEL = "smollm2-135m"


class Opts:
    """What the command line sets for every run (defaults: the dev box's case)."""
    model = MODEL
    device, dtype = "cpu", "float32"
    prompts, prompt_len, new_tokens = 32, 1100, 64
    ranks = (2,)                      # mpiexec -n values besides local mode
    launcher = None                   # default: the mpiexec on PATH
    chunk = 8192                      # the engine's --max-prefill-tokens (the S-part alone groups alike)

    @classmethod
    def engine(cls) -> list[str]:
        kv = "fp32" if cls.dtype == "float32" else "bf16"
        return ["--device", cls.device, "--dtype", cls.dtype, "--kv-dtype", kv,
                "--max-prefill-tokens", str(cls.chunk)]
STDLIB = ("collections", "json", "argparse", "subprocess", "threading", "asyncio", "pathlib", "typing",
          "functools", "itertools", "logging", "unittest", "email", "http.client", "xml.dom", "sqlite3",
          "decimal", "fractions", "statistics", "datetime", "calendar", "random", "re", "string",
          "textwrap", "difflib", "csv", "configparser", "tarfile", "zipfile", "shutil", "tempfile")


# ----------------------------------------------------------------------------- the workloads

def token_stream() -> list[int]:
    """The standard library's docstrings, tokenized: plain English and code, stable per Python."""
    import importlib
    import pydoc

    from fastdecode.model.source import resolve_model
    from fastdecode.model.tokenizer import Tokenizer
    texts = []
    for name in STDLIB:
        mod = importlib.import_module(name)
        texts.append(pydoc.render_doc(mod, renderer=pydoc.plaintext))
        texts.extend(inspect.getdoc(obj) or "" for _, obj in sorted(vars(mod).items())
                     if inspect.isclass(obj) or inspect.isfunction(obj))
    from fastdecode.model.config import ConfigError
    from fastdecode.model.source import read_config
    text = "\n\n".join(texts)
    vocab = read_config(resolve_model(Opts.model)).vocab_size       # a random model's may be smaller
    try:
        ids = Tokenizer(resolve_model(MODEL)).encode_text(text)
    except ConfigError:
        if Opts.model == MODEL:
            raise
        # a random-weight model on a box without the embedded model: the text's bytes as ids
        # (prefill costs the same whatever the ids; the prompt lengths are what matter)
        ids = list(text.encode())
    return [t % vocab for t in ids]


def workload(kind: str, stream: list[int]) -> list[tuple[list[int], int]]:
    """[(prompt token ids, new tokens)]; prompts are disjoint windows of the stream where it is long
    enough, else windows starting further on."""
    import random
    rng = random.Random(0)
    if kind == "long":
        shapes = [(Opts.prompt_len, Opts.new_tokens)] * Opts.prompts
    else:
        shapes = [(rng.randint(100, 4000), rng.choice((16, 32, 64, 128, 256))) for _ in range(32)]
    out, at = [], 0
    for n, new in shapes:
        if at + n > len(stream):
            at = rng.randrange(0, len(stream) - n)
        out.append((stream[at:at + n], new))
        at += n
    return out


def batch_file(path: str, work: list[tuple[list[int], int]]) -> None:
    with open(path, "w") as f:
        for i, (ids, new) in enumerate(work):
            body = {"prompt": ids, "max_tokens": new, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


# ----------------------------------------------------------------------------- the systems

def run_fastdecode(inp: str, ranks: int | None, extra: list[str]) -> dict:
    out, stats = tempfile.mktemp(suffix=".jsonl"), tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, "-m", "fastdecode", "generate", "-m", Opts.model, "-i", inp, "-o", out, "--quiet",
           "--overwrite", "--stats-json", stats, *extra]
    if ranks:
        cmd = (Opts.launcher.split() if Opts.launcher else [shutil.which("mpiexec")]) + ["-n", str(ranks)] + cmd
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(stats) as f:
        doc = json.load(f)
    with open(out) as f:
        rows = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in map(json.loads, f)}
    summary = doc["summary"]
    return {"system": "fastdecode local" if not ranks else f"fastdecode {ranks - 1} R-worker(s), mpiexec -n {ranks}",
            "args": extra, "process_wall_s": round(wall, 2), "generate_wall_s": summary["wall_s"],
            "decode_s": summary["decode_s"], "prefill": summary.get("prefill"),
            "prefill_steps": [s["prefill"] for s in doc["steps"] if "prefill" in s],
            "output_tokens": summary["output_tokens"], "prompt_tokens": summary["prompt_tokens"],
            "token_latency_p50_s": summary.get("token_latency_p50_s"),
            "token_latency_p99_s": summary.get("token_latency_p99_s"),
            "texts": {k: v["text"] for k, v in sorted(rows.items())}}


HF_CODE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
from fastdecode.model.source import resolve_model
work = json.load(open(sys.argv[1]))
src = resolve_model(sys.argv[2])
import os
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                             dtype=torch.float32).eval()
t_load = time.perf_counter()
ids = [w[0] for w in work]
new = max(w[1] for w in work)
pad = 0
width = max(map(len, ids))
inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
with torch.inference_mode():
    t = time.perf_counter()
    model(input_ids=inp, attention_mask=mask, use_cache=False, logits_to_keep=1)      # prefill alone
    t_prefill = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=pad)
    t_gen = time.perf_counter() - t
print(json.dumps({"load_s": t_load - t0, "prefill_forward_s": t_prefill, "generate_s": t_gen,
                  "output_tokens": int((out.shape[1] - width) * len(ids))}))
"""


def run_hf(work: list[tuple[list[int], int]]) -> dict:
    """A fresh process: import, load, one prefill forward (timed alone), then `generate`. The
    process wall minus the lone forward is what a user of HF waits for."""
    path = tempfile.mktemp(suffix=".json")
    with open(path, "w") as f:
        json.dump(work, f)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", HF_CODE, path, MODEL], capture_output=True, text=True,
                          cwd=REPO, check=False, env={**os.environ, "PYTHONPATH": REPO})
    wall = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"system": "hf-transformers generate (fp32, one left-padded batch)",
            "process_wall_s": round(wall - r["prefill_forward_s"], 2), "load_s": round(r["load_s"], 2),
            "generate_s": round(r["generate_s"], 2), "prefill_forward_s": round(r["prefill_forward_s"], 2),
            "output_tokens": r["output_tokens"]}


S_PART_CODE = r"""
import json, sys, time
import torch
from fastdecode.model.llama import LlamaSPart
from fastdecode.model.source import read_config, resolve_model
from fastdecode.model.weights import load_weights
from rworker.host.threads import physical_cpus
torch.set_num_threads(len(physical_cpus()))
steps = json.load(open(sys.argv[1]))          # [[prompt lengths of one prefill step], ...]
model, device, dtype = sys.argv[2], torch.device(sys.argv[3]), getattr(torch, sys.argv[4])
src = resolve_model(model); cfg = read_config(src)
m = LlamaSPart(cfg, load_weights(src, cfg, dtype, device), device, dtype)
gen = torch.Generator().manual_seed(0)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
total = tokens = 0
with torch.inference_mode():
    for rep in range(2):                       # the first pass warms the allocator and kernels
        total = tokens = 0
        for lengths in steps:
            ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=gen).to(device)
            pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
            sync(); t = time.perf_counter()
            x = m.embed_tokens(ids); rope = m.rope.cos_sin(pos)
            for layer in range(cfg.num_layers):
                q, k, v = m.qkv(layer, x, rope)
                x = m.post_attn(layer, x, m.prompt_attention(layer, q, k, v, lengths))
            m.logits(x[torch.tensor(lengths, device=device).cumsum(0) - 1])
            sync(); total += time.perf_counter() - t
            tokens += sum(lengths)
print(json.dumps({"tokens": tokens, "wall_s": total, "tokens_per_s": tokens / total,
                  "threads": torch.get_num_threads(), "device": str(device), "dtype": str(dtype)}))
"""


def run_s_part(step_lengths: list[list[int]], dtype: str | None = None) -> dict:
    """The S-part's prefill alone over the same prefill batches (no R-part, no wire)."""
    path = tempfile.mktemp(suffix=".json")
    with open(path, "w") as f:
        json.dump(step_lengths, f)
    proc = subprocess.run([sys.executable, "-c", S_PART_CODE, path, Opts.model, Opts.device, dtype or Opts.dtype],
                          capture_output=True, text=True,
                          cwd=REPO, check=False, env={**os.environ, "PYTHONPATH": REPO})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the runs

def prefill_batches(work: list[tuple[list[int], int]], max_tokens: int) -> list[list[int]]:
    """Prompt lengths per prefill step as the scheduler packs a queue that is all admitted at once."""
    steps, cur = [], []
    for ids, _ in work:
        if cur and sum(cur) + len(ids) > max_tokens:
            steps.append(cur)
            cur = []
        cur.append(len(ids))
    return steps + [cur]


def long_workload(stream, skip_hf: bool) -> dict:
    work = workload("long", stream)
    inp = tempfile.mktemp(suffix=".jsonl")
    batch_file(inp, work)
    engine = Opts.engine() + ["--max-batch", str(len(work))]
    res = {"prompts": len(work), "prompt_tokens": sum(len(w[0]) for w in work), "new_tokens": work[0][1],
           "runs": []}
    if not skip_hf:
        res["hf"] = run_hf(work)
        print("hf", res["hf"], flush=True)
    res["s_part"] = run_s_part(prefill_batches(work, Opts.chunk))
    print("s-part alone", res["s_part"], flush=True)
    texts = None
    for ranks in (None, *Opts.ranks):
        r = run_fastdecode(inp, ranks, engine)
        texts = texts or r["texts"]
        r["same_text_as_local"] = r.pop("texts") == texts
        pf = r["prefill"]
        r["prefill_vs_s_part"] = round(pf["tokens_per_s"] / res["s_part"]["tokens_per_s"], 3)
        if "hf" in res:
            r["hf_wall_over_ours"] = round(res["hf"]["process_wall_s"] / r["process_wall_s"], 3)
        print(r["system"], {k: v for k, v in r.items() if k != "prefill_steps"}, flush=True)
        res["runs"].append(r)
    if Opts.device == "cpu" and Opts.dtype == "float32":     # what --dtype bfloat16 gives on this CPU
        res["s_part_bf16"] = run_s_part(prefill_batches(work, Opts.chunk), "bfloat16")
        r = run_fastdecode(inp, None, [a if a not in ("float32", "fp32") else {"float32": "bfloat16", "fp32": "bf16"}[a]
                                       for a in engine])
        r["system"] += " --dtype bfloat16 (bf16 KV)"
        r["same_text_as_local"] = r.pop("texts") == texts
        r["prefill_vs_s_part"] = round(r["prefill"]["tokens_per_s"] / res["s_part_bf16"]["tokens_per_s"], 3)
        if "hf" in res:
            r["hf_wall_over_ours"] = round(res["hf"]["process_wall_s"] / r["process_wall_s"], 3)
        print(r["system"], {k: v for k, v in r.items() if k != "prefill_steps"}, flush=True)
        res["runs"].append(r)
    return res


def mixed_workload(chunks: list[int]) -> dict:
    work = workload("mixed", token_stream())
    inp = tempfile.mktemp(suffix=".jsonl")
    batch_file(inp, work)
    engine = Opts.engine() + ["--max-batch", "64"]
    res = {"prompts": len(work), "prompt_tokens": sum(len(w[0]) for w in work),
           "output_tokens": sum(w[1] for w in work), "runs": []}
    texts = None
    for ranks, chunk in [(None, 0), *[(None, c) for c in chunks], (Opts.ranks[0], 0), (Opts.ranks[0], chunks[-1])]:
        r = run_fastdecode(inp, ranks, engine + (["--max-num-batched-tokens", str(chunk)] if chunk else []))
        texts = texts or r["texts"]
        r["same_text_as_unchunked"] = r.pop("texts") == texts
        r.pop("prefill_steps")
        r["chunk"] = chunk or None
        r["tokens_per_s"] = round((r["output_tokens"] + r["prompt_tokens"]) / r["process_wall_s"], 2)
        print(r, flush=True)
        res["runs"].append(r)
    for r in res["runs"]:       # against the unchunked run of the same mode (local, mpiexec)
        base = next(b for b in res["runs"] if b["system"] == r["system"] and b["chunk"] is None)
        r["vs_unchunked"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    return res


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    long = result.get("long")
    if not long:
        return
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names, phases = [], ("s_compute_s", "s_attention_s", "pack_s", "wait_s")
    rows = []
    for r in long["runs"]:
        pf = r["prefill"]
        rest = r["process_wall_s"] - pf["wall_s"]
        rows.append([pf[p] for p in phases] + [max(pf["r_append_s"]), rest])
        names.append(r["system"])
    if "hf" in long:
        hf = long["hf"]
        rows.append([0, 0, 0, 0, 0, hf["process_wall_s"]])
        names.append("HF generate")
    labels = ["S-part dense", "prompt attention", "packing", "waiting on R", "R appends (overlapped)",
              "decode + start-up (HF: all)"]
    left = [0.0] * len(rows)
    for j, lab in enumerate(labels):
        vals = [row[j] for row in rows]
        if j == 4:        # appends overlap the S-part: drawn beside, not stacked
            continue
        ax.barh(names, vals, left=left, label=lab)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("seconds (process wall)")
    ax.set_title(f"{long['prompts']} prompts x {long['prompt_tokens'] // long['prompts']} tokens, "
                 f"{long['new_tokens']} new ({result['label']})")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default=platform.node() or "host")
    ap.add_argument("--workload", choices=("long", "mixed", "both"), default="both")
    ap.add_argument("--chunks", default="512,2048", help="--max-num-batched-tokens values (mixed)")
    ap.add_argument("--skip-hf", action="store_true", help="no HF transformers peer (it loads only the embedded model)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=Opts.prompts)
    ap.add_argument("--prompt-len", type=int, default=Opts.prompt_len)
    ap.add_argument("--new-tokens", type=int, default=Opts.new_tokens)
    ap.add_argument("--ranks", default="2", help="mpiexec -n values besides local mode, comma-separated")
    ap.add_argument("--launcher", default=None, help="the MPI launcher command (default: mpiexec on PATH)")
    ap.add_argument("--max-prefill-tokens", type=int, default=Opts.chunk)
    args = ap.parse_args()
    Opts.model, Opts.device, Opts.dtype, Opts.launcher = args.model, args.device, args.dtype, args.launcher
    Opts.prompts, Opts.prompt_len, Opts.new_tokens = args.prompts, args.prompt_len, args.new_tokens
    Opts.ranks, Opts.chunk = [int(r) for r in args.ranks.split(",")], args.max_prefill_tokens
    result = {"label": args.label, "cpu": platform.processor(), "cores": os.cpu_count(),
              "model": f"{Opts.model} ({Opts.dtype} S-part on {Opts.device})", "date": time.strftime("%Y-%m-%d")}
    try:
        import subprocess as sp
        result["commit"] = sp.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=REPO, check=False).stdout.strip()
    except OSError:
        pass
    if args.workload in ("long", "both"):
        result["long"] = long_workload(token_stream(), args.skip_hf or Opts.model != MODEL)
    if args.workload in ("mixed", "both"):
        result["mixed"] = mixed_workload([int(c) for c in args.chunks.split(",") if c])
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"prefill_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, path[:-5] + ".png")
    print("wrote", path)


if __name__ == "__main__":
    main()
