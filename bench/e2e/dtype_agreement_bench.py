"""What a CPU S-worker's `--dtype auto` costs: its outputs against `--dtype float32`'s, and the
invariances each dtype keeps.

On a CPU with AVX512-BF16 or AMX, `auto` computes a checkpoint that is not float32 in bfloat16
(engine/args.py: auto_dtype); `float32` gives HF transformers' float32 tokens. Three models: the
embedded smollm2-135m (GGUF, names no dtype: auto -> bf16 here) and two tiny random-weight HF
families saved in bfloat16 (qwen3 and mistral of tests/family_cases.py: 4 layers, their real
vocabularies, weights of std 1/sqrt(hidden)). On each, LLM(model) (the default dtype, recorded as
it resolved) against LLM(model, dtype="float32"), greedy with EOS ignored:

1. agreement: N prompts x T tokens (chat-like texts for the embedded model, random token ids of
   20-80 tokens for the tiny ones). Teacher-forced: with float32's tokens as history
   (prompt_logprobs over prompt + float32 tokens), the share of positions where float32's token is
   the default's greedy choice (strict: argmax's pick among tied logits; and with ties counted). Free-running: the share
   of tokens before each sequence's first divergence, and of identical sequences. A control in
   each dtype: teacher-forced on its own free-running tokens (its prefill's choices against its
   decode's);
2. batch invariance, in each dtype: the first 16 prompts (--singles) generated alone (a batch of
   1) against the same prompts within the batch of N: identical requests, and tokens before the
   first divergence;
3. layout invariance (the embedded model only): the N prompts through `python3 -m fastdecode
   generate` in local mode and under `mpiexec -n 2` (one R-worker), in each dtype: identical texts.

Random weights give flat next-token distributions (small top-2 margins, reported), so the tiny
models' agreement is a floor: a trained model's wider margins flip less under bf16 rounding.
Writes bench/e2e/results/dtype_agreement_<label>.json and prints a table.

    nice -n 10 python3 bench/e2e/dtype_agreement_bench.py --label devbox-2core-zen5   # 5-15 min on 2 cores
    python3 bench/e2e/dtype_agreement_bench.py --label smoke --quick                    # 8 prompts x 8 tokens
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
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)                         # this checkout's packages
sys.path.insert(0, os.path.join(REPO, "tests"))  # family_cases: the tiny HF models

EMBEDDED = "smollm2-135m"
TOPICS = ["the ocean", "a lighthouse", "mathematics", "a city at night", "coffee", "the moon", "trains",
          "a library", "mountains", "rain", "music", "a robot", "gardens", "winter", "friendship", "the desert"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
         "Describe {} in detail."]
# tiny families: family_cases' configs with the family's real vocabulary, 4 layers, and weights of
# std 1/sqrt(hidden) (256 for both), which keeps activations of unit scale through the layers.
# family_cases' own std (0.3, to make its tests bite) grows them layer by layer until bf16's
# relative rounding is large in absolute terms: on mistral, 16 prompts x 32 tokens, teacher-forced (ties
# counted) agreement 0.66 at std 0.3 against 0.99 at 0.0625 (qwen3, with q/k norms: 0.96 against 0.99).
# gemma2 was tried too: its tied random embeddings make every sequence repeat one token, which no
# rounding changes (agreement 1.0 that says nothing); mistral is the llama-style family, untied.
TINY = {"qwen3": dict(vocab_size=151936, num_hidden_layers=4, initializer_range=0.0625),
        "mistral": dict(vocab_size=32768, num_hidden_layers=4, initializer_range=0.0625)}
SINGLES = 16                                     # prompts also generated alone
TOP_SEEN = 5                                     # prompt logprobs per position (ties for the top)
FLOAT32 = "float32"
DEFAULT = "default"


# ---- prompts and models ----

def chat_texts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[i % len(TOPICS)]) + f" (#{i})" for i in range(n)]


def random_prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """n prompts of 20-80 random token ids (past the special ids 0-2)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 81, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def save_word_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer over `vocab` ids (the engine loads one; the prompts are ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0").save_pretrained(path)


def build_tiny(name: str, root: Path) -> str:
    """family_cases' model `name` with TINY's overrides, saved in bfloat16 (its config then names
    bfloat16, which `auto` reads) with a tokenizer -> its directory."""
    from family_cases import build_hf
    path, model = build_hf(name, root, **TINY[name])
    model.to(torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, TINY[name]["vocab_size"])
    saved = json.load(open(os.path.join(path, "config.json")))
    assert (saved.get("torch_dtype") or saved.get("dtype")) == "bfloat16", saved
    return path


# ---- measures ----

def greedy(new: int):
    from fastdecode import SamplingParams
    return SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)


def generate(llm, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list[str]]:
    outs = llm.generate(prompts, greedy(new), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


def agreed_prefix(a: list[int], b: list[int]) -> int:
    """Tokens before the first position where a and b differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(ref: list[list], other: list[list]) -> dict:
    """Identical sequences, and tokens before each one's first divergence, as shares."""
    total = sum(len(r) for r in ref)
    return {"identical": round(sum(r == o for r, o in zip(ref, other)) / len(ref), 4),
            "prefix_tokens": round(sum(agreed_prefix(r, o) for r, o in zip(ref, other)) / total, 4),
            "requests": len(ref)}


def teacher_forced(llm, prompts: list[list[int]], ref: list[list[int]]) -> dict:
    """With prompt + ref as history, at each of ref's positions: is ref's token the greedy choice?
    A bf16 S-part rounds its logits to bf16, where near-ties become ties, and greedy (argmax) takes
    the lowest id among the tied: top1_strict counts ref's token where it is that one (of the top
    TOP_SEEN seen), top1 wherever it is tied for the top. Also the share of positions with a tie for
    the top, and the median top-2 margin (nats: how flat the model's choices are)."""
    from fastdecode import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP_SEEN)
    outs = llm.generate([p + r for p, r in zip(prompts, ref)], params, use_tqdm=False)
    agree = strict = 0
    margins = []
    for p, r, out in zip(prompts, ref, outs):
        for tok, entry in zip(r, out.prompt_logprobs[len(p):]):     # the entries predicting r[0] .. r[-1]
            top = sorted((lp.logprob for lp in entry.values()), reverse=True)
            tied = [t for t, lp in entry.items() if lp.logprob == top[0]]   # (the entry's ranks are by position)
            agree += tok in tied
            strict += min(tied) == tok
            margins.append(top[0] - top[1])
    n = len(margins)
    return {"top1_strict": round(strict / n, 4), "top1": round(agree / n, 4), "positions": n,
            "tied_top": round(sum(m == 0 for m in margins) / n, 4),
            "median_top2_margin": round(float(torch.tensor(margins).median()), 4)}


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, round(time.perf_counter() - t, 2)


def run_dtype(model: str, dtype: str, prompts: list[list[int]], new: int, singles: int,
              ref: list[list[int]] | None = None) -> tuple[list[list[int]], list[str], dict]:
    """One dtype's runs on a model: the batch, its first `singles` prompts alone, the teacher-forced
    pass over its own batch (the control: its prefill's choices against its decode's) and, ref given,
    over ref. -> (the batch's tokens, its texts, figures)."""
    from fastdecode import LLM
    llm, load_s = timed(lambda: LLM(model, **({} if dtype == DEFAULT else {"dtype": dtype})))
    fig = {"resolved": str(llm.engine.dtype).removeprefix("torch."), "kv_dtype": llm.engine.kv_dtype,
           "timings_s": {"load": load_s}}
    (batch, texts), fig["timings_s"]["batch"] = timed(generate, llm, prompts, new)
    alone, fig["timings_s"]["singles"] = timed(lambda: [generate(llm, [p], new)[0][0] for p in prompts[:singles]])
    fig["batch_invariance"] = compare(batch[:singles], alone)
    fig["distinct_token_share"] = round(sum(len(set(b)) / len(b) for b in batch) / len(batch), 4)  # 1/T: one repeated
    fig["teacher_forced_control"], fig["timings_s"]["teacher_forced_control"] = timed(teacher_forced, llm, prompts,
                                                                                      batch)
    if ref is not None:
        fig["teacher_forced"], fig["timings_s"]["teacher_forced"] = timed(teacher_forced, llm, prompts, ref)
        fig["free_running_vs_float32"] = compare(ref, batch)
    print(f"  {os.path.basename(model)} {dtype}: {fig}", flush=True)
    llm.close()
    return batch, texts, fig


def measure_model(model: str, prompts: list[list[int]], new: int, singles: int) -> tuple[dict, dict]:
    """float32 first (its batch is the reference), then the default dtype -> (figures, each
    dtype's batch texts)."""
    ref, ref_texts, fp32 = run_dtype(model, FLOAT32, prompts, new, singles)
    _, texts, default = run_dtype(model, DEFAULT, prompts, new, singles, ref)
    return {"dtypes": {DEFAULT: default, FLOAT32: fp32}}, {DEFAULT: texts, FLOAT32: ref_texts}


# ---- layout: local mode against one R-worker ----

def batch_file(path: str, texts: list[str], new: int) -> None:
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            body = {"prompt": t, "max_tokens": new, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def cli_texts(inp: str, dtype: str, ranks: int | None, tries: int = 2) -> tuple[dict, float, list[str]]:
    """`fastdecode generate` on the batch file -> ({custom_id: text}, wall seconds, the failed
    tries' last stderr lines). A failed run is retried once (the tree is shared with other work)."""
    out = tempfile.mktemp(suffix=".jsonl")
    cmd = [sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out, "--overwrite"]
    if dtype != DEFAULT:
        cmd += ["--dtype", dtype]
    if ranks:
        cmd = [shutil.which("mpiexec"), "-n", str(ranks)] + cmd
    failures = []
    for _ in range(tries):
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        wall = round(time.perf_counter() - t, 2)
        if proc.returncode == 0:
            break
        failures.append(proc.stderr.strip()[-600:])
        print(f"  failed ({' '.join(cmd[-8:])}):\n{failures[-1]}", flush=True)
    else:
        raise RuntimeError(f"{' '.join(cmd)} failed {tries} times")
    with open(out) as f:
        rows = [json.loads(line) for line in f]
    os.unlink(out)
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows}, wall, failures


def layout_invariance(texts: list[str], new: int, api_texts: dict[str, list[str]]) -> dict:
    """Per dtype: identical texts between local mode and `mpiexec -n 2`; and local mode's CLI
    against the LLM API's batch of the same dtype (a check that both paths run the same job)."""
    inp = tempfile.mktemp(suffix=".jsonl")
    batch_file(inp, texts, new)
    result = {}
    for dtype in (DEFAULT, FLOAT32):
        local, local_s, local_failed = cli_texts(inp, dtype, None)
        mpi, mpi_s, mpi_failed = cli_texts(inp, dtype, 2)
        ids = [f"p{i}" for i in range(len(texts))]
        result[dtype] = {"identical_local_vs_1rworker": round(sum(local[i] == mpi[i] for i in ids) / len(ids), 4),
                         "identical_cli_local_vs_api": round(sum(local[i] == a for i, a in zip(ids, api_texts[dtype]))
                                                             / len(ids), 4),
                         "requests": len(ids), "timings_s": {"local": local_s, "mpiexec_n2": mpi_s},
                         "failed_tries": local_failed + mpi_failed}
    os.unlink(inp)
    return result


# ---- the machine, the table, the run ----

def cpu_info() -> dict:
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    name = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                 .stdout.splitlines() if line.startswith("Model name")), platform.processor())
    return {"model_name": name, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx": any(f.startswith("amx") for f in flags)}


def pair(fig: dict, a: str, b: str) -> str:
    return f"{fig[a]:.3f}/{fig[b]:.3f}"


def table(models: dict) -> str:
    head = (f"{'model':<14} {'default':>8} {'tf strict':>9} {'tf tie':>7} {'def ctl':>8} {'f32 ctl':>8} "
            f"{'free pre':>8} {'free id':>8} {'bi def id/pre':>14} {'bi f32 id/pre':>14} {'layout def/f32':>15}")
    rows = [head, "-" * len(head)]
    for name, m in models.items():
        d, f = m["dtypes"][DEFAULT], m["dtypes"][FLOAT32]
        layout = m.get("layout_invariance")
        lay = f"{layout[DEFAULT]['identical_local_vs_1rworker']:.3f}/" \
              f"{layout[FLOAT32]['identical_local_vs_1rworker']:.3f}" if layout else "-"
        free = d["free_running_vs_float32"]
        rows.append(f"{name:<14} {d['resolved']:>8} {d['teacher_forced']['top1_strict']:>9.4f} "
                    f"{d['teacher_forced']['top1']:>7.4f} "
                    f"{d['teacher_forced_control']['top1_strict']:>8.4f} "
                    f"{f['teacher_forced_control']['top1_strict']:>8.4f} "
                    f"{free['prefix_tokens']:>8.4f} {free['identical']:>8.4f} "
                    f"{pair(d['batch_invariance'], 'identical', 'prefix_tokens'):>14} "
                    f"{pair(f['batch_invariance'], 'identical', 'prefix_tokens'):>14} {lay:>15}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default=platform.node() or "host")
    ap.add_argument("--quick", action="store_true", help="8 prompts x 8 tokens: a smoke test")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--singles", type=int, default=SINGLES, help="prompts also generated alone")
    args = ap.parse_args()
    n, new = (8, 8) if args.quick else (args.prompts, args.new_tokens)
    singles = min(args.singles, n)
    import transformers
    start = time.perf_counter()
    result = {"label": args.label, "cpu": cpu_info(), "torch": torch.__version__,
              "transformers": transformers.__version__, "quick": args.quick, "prompts": n, "new_tokens": new,
              "singles": singles, "load_average_start": os.getloadavg(), "models": {}}

    from fastdecode import LLM
    texts = chat_texts(n)
    tok = LLM(EMBEDDED, dtype=FLOAT32)
    chat_ids = [tok.engine.tokenizer.encode(t) for t in texts]
    tok.close()
    t = time.perf_counter()
    emb, api_texts = measure_model(EMBEDDED, chat_ids, new, singles)
    emb["source"] = "embedded GGUF (names no dtype); chat-like text prompts"
    emb["timings_s"] = {"api": round(time.perf_counter() - t, 2)}
    t = time.perf_counter()
    emb["layout_invariance"] = layout_invariance(texts, new, api_texts)
    emb["timings_s"]["layout"] = round(time.perf_counter() - t, 2)
    result["models"][EMBEDDED] = emb
    print(f"{EMBEDDED} done ({time.perf_counter() - start:.0f} s)", flush=True)

    with tempfile.TemporaryDirectory() as root:
        for name in TINY:
            t = time.perf_counter()
            path = build_tiny(name, Path(root))
            m, _ = measure_model(path, random_prompts(n, TINY[name]["vocab_size"]), new, singles)
            m["source"] = (f"tests/family_cases.py '{name}' with {TINY[name]} (norms/biases jittered), random "
                           f"weights saved in bfloat16; random token-id prompts of 20-80 tokens. Random weights give "
                           f"flat distributions (see median_top2_margin): a floor for a trained model's agreement")
            m["timings_s"] = {"total": round(time.perf_counter() - t, 2)}
            result["models"][name] = m
            print(f"{name} done ({time.perf_counter() - start:.0f} s)", flush=True)

    result["total_s"] = round(time.perf_counter() - start, 1)
    result["load_average_end"] = os.getloadavg()      # the cores are shared: timings are indicative only
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"dtype_agreement_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
    print(table(result["models"]))
    print("tf strict/tie: teacher-forced top-1 agreement with float32 (argmax's pick; ties for the top counted); "
          "def/f32 ctl: each dtype teacher-forced on its own decode (strict); free pre/id: free-running tokens "
          "before the first divergence / identical sequences; bi: batch invariance (alone vs in the batch), "
          "identical/prefix; layout: identical, local vs mpiexec -n 2")


if __name__ == "__main__":
    main()
