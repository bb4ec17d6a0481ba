"""fp8 weights against float weights: teacher-forced greedy agreement and mean |delta logprob|, on
the embedded model and a tiny random model of each family.

The embedded model (smollm2-135m, float32 on the CPU): 64 varied prompts, each followed by the
float32 model's own 64 greedy tokens (the prompts and length of bench/kernel/int8_agreement.py,
so the numbers compare with int8 KV's); every variant then reads the same sequences (teacher
forced) and at each generated position we compare its argmax with the float32 model's, and the
log-probability it gives the float32 model's token. The tiny models (tests/family_cases.py, 3
layers, HF's initialization std 0.02, random weights): 8 random token sequences of 41-80 tokens,
every position scored.

Variants (each against float32 weights and activations):
- fp8: `--quantization fp8` as a CPU runs it: e4m3 weights (per output channel) dequantized to
  float32, the activations untouched. On the CPU this measures the weights' quantization error
  only;
- fp8_w8a8: the same weights with the activations quantized to e4m3 per token too, through
  torch._scaled_mm on torch's CPU kernel with float32 output: what a GPU with fp8 GEMMs
  computes, up to the order of its sums and its output's rounding;
- noise: Gaussian noise of the same energy as fp8's rounding added to every projection (a
  control: how many argmaxes any perturbation of fp8's size flips on that model);
- bf16_weights: the weights rounded to bf16 (computed in float32): bf16's own distance.
Reported per model: positions, each variant's top-1 agreement and mean (and max) |delta logprob|
of the reference token, fp8's relative weight error (Frobenius, mean over projections), and the
median top-2 margin of the reference logits (random models' flat outputs flip under any
perturbation; a trained model's margins are wide). And an ablation on the embedded model's first
16 prompts: fp8 (W8A16) on parts of it only, and with one scale per tensor.

    python3 bench/e2e/fp8_accuracy_bench.py --label devbox-2core        # ~10 minutes on 2 cores, + .png
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)

from fastdecode.model import fp8_gemm
from fastdecode.model.fp8 import Fp8Weight
from fastdecode.model.quantization import is_projection
from fastdecode.model.source import read_config, resolve_model
from fastdecode.model.spart import SPart
from fastdecode.model.weights import load_weights
from tests.family_cases import CASES, build_hf, prompt_logits, prompts
from tests.test_bf16_spart import FORMS, TOPICS

VARIANTS = ("fp8", "fp8_w8a8", "noise", "bf16_weights")
NEW_TOKENS = 64
GROUP = 8                 # sequences per packed forward


def variant_weights(floats: dict, name: str, seed: int = 0) -> dict:
    """The float32 weights as variant `name` holds them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, w in floats.items():
        if not is_projection(k):
            out[k] = w
        elif name in ("fp8", "fp8_w8a8"):
            out[k] = Fp8Weight.quantize(w)
        elif name == "noise":
            delta = Fp8Weight.quantize(w).dequantize(torch.float32) - w
            noise = torch.randn(w.shape, generator=g)
            out[k] = w + noise * (delta.norm() / noise.norm())
        else:                                                   # bf16_weights
            out[k] = w.to(torch.bfloat16).float()
    return out


def weight_error(floats: dict) -> float:
    errs = [float((Fp8Weight.quantize(w).dequantize(torch.float32) - w).norm() / w.norm())
            for k, w in floats.items() if is_projection(k)]
    return sum(errs) / len(errs)


@torch.no_grad()
def logprobs(m: SPart, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence its log-softmax [len, V] float64, the packed prompt path in groups."""
    out = []
    for i in range(0, len(seqs), GROUP):
        group = seqs[i:i + GROUP]
        logits, _ = prompt_logits(m, group)
        out += list(torch.log_softmax(logits.double(), dim=-1).split([len(s) for s in group]))
    return out


def score(ref: list[torch.Tensor], got: list[torch.Tensor], seqs: list[torch.Tensor], first: list[int]) -> dict:
    """Top-1 agreement over the rows of each sequence that predict its tokens first[i].. (the
    last row predicts past the end: not scored), and |delta logprob| of the reference's greedy
    token there."""
    agree = total = 0
    deltas = []
    for r, g, s, f in zip(ref, got, seqs, first):
        r, g = r[f - 1:-1], g[f - 1:-1]                            # rows predicting tokens f..
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += r.shape[0]
        target = r.argmax(-1, keepdim=True)                         # the reference's greedy token
        deltas.append((r.gather(-1, target) - g.gather(-1, target)).abs().squeeze(-1))
    d = torch.cat(deltas)
    return {"agree": agree, "top1_agreement": round(agree / total, 5),
            "mean_abs_delta_logprob": round(float(d.mean()), 5), "max_abs_delta_logprob": round(float(d.max()), 4)}


def margins(ref: list[torch.Tensor], first: list[int]) -> float:
    top2 = torch.cat([r[f - 1:-1] for r, f in zip(ref, first)]).topk(2, dim=-1).values
    return round(float((top2[:, 0] - top2[:, 1]).median()), 4)


def bench_model(label: str, source, seqs: list[torch.Tensor], first: list[int]) -> dict:
    t0 = time.perf_counter()
    config = read_config(source)
    floats = load_weights(source, config, torch.float32)
    ref = logprobs(SPart(config, floats, "cpu", torch.float32), seqs)
    row = {"model": label, "model_type": config.model_type, "sequences": len(seqs),
           "positions": sum(len(s) - f for s, f in zip(seqs, first)),
           "fp8_weight_rel_error": round(weight_error(floats), 5), "median_top2_margin": margins(ref, first)}
    for name in VARIANTS:
        path = fp8_gemm.Fp8Path("rowwise", "torch's CPU _scaled_mm") if name == "fp8_w8a8" else None
        with fp8_gemm.forced_path(path) if path else contextlib.nullcontext():
            m = SPart(config, variant_weights(floats, name), "cpu", torch.float32)
            row[name] = score(ref, logprobs(m, seqs), seqs, first)
        del m
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), flush=True)
    return row


ABLATION = {   # name -> which projections are fp8 (per output channel unless said)
    "all": lambda k: True,
    "all, one scale per tensor": lambda k: True,
    "attention only (qkv, o)": lambda k: ".self_attn." in k,
    "gate/up only": lambda k: "gate_proj" in k or "up_proj" in k,
    "down only": lambda k: "down_proj" in k,
    "layers 0-1 only": lambda k: k.startswith(("model.layers.0.", "model.layers.1.")),
    "last two layers only": lambda k: k.startswith(("model.layers.28.", "model.layers.29.")),
}


def per_tensor(w: torch.Tensor) -> torch.Tensor:
    """w rounded to e4m3 with one scale for the whole tensor, back in float32."""
    scale = w.abs().max() / 448
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def ablation(seqs: list[torch.Tensor], first: list[int]) -> dict:
    """The embedded model with fp8 on parts of it (W8A16): where the flips come from."""
    source = resolve_model("smollm2-135m")
    config = read_config(source)
    floats = load_weights(source, config, torch.float32)
    ref = logprobs(SPart(config, floats, "cpu", torch.float32), seqs)
    out = {"sequences": len(seqs), "positions": sum(len(s) - f for s, f in zip(seqs, first))}
    for name, chosen in ABLATION.items():
        quant = per_tensor if "per tensor" in name else (lambda w: Fp8Weight.quantize(w).dequantize(torch.float32))
        w = {k: quant(v) if is_projection(k) and chosen(k) else v for k, v in floats.items()}
        out[name] = score(ref, logprobs(SPart(config, w, "cpu", torch.float32), seqs), seqs, first)
        print(name, json.dumps(out[name]), flush=True)
    return out


def embedded_sequences(n: int) -> tuple[list[torch.Tensor], list[int]]:
    """n chat prompts followed by the float32 model's own greedy tokens (generated with LLM)."""
    from fastdecode import LLM, SamplingParams
    texts = [FORMS[i % 4].format(TOPICS[i % 16]) + f" (#{i})" for i in range(n)]
    llm = LLM("smollm2-135m", dtype="float32", kv_dtype="fp32", device="cpu", max_batch=n, quiet=True)
    try:
        ids = [llm.engine.tokenizer.encode(t) for t in texts]
        outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                            SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    seqs = [torch.tensor(p + o.outputs[0].token_ids) for p, o in zip(ids, outs)]
    return seqs, [len(p) for p in ids]              # scored: the generated tokens


def plot(result: dict, path: str) -> None:
    """Top-1 agreement per model and variant, the issue's 99% target as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    width = 0.8 / len(VARIANTS)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for j, name in enumerate(VARIANTS):
        xs = [i + (j - (len(VARIANTS) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [100 * r[name]["top1_agreement"] for r in rows], width, label=name)
    ax.axhline(99, color="k", lw=0.8, ls="--", label="target 99%")
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylim(75, 100.5)
    ax.set_ylabel("teacher-forced top-1 agreement with float32, %")
    ax.set_title(f"fp8 weights against float32 ({result['label']}); median top-2 margin: smollm2 "
                 f"{rows[0]['median_top2_margin']:.2f} nats, tiny random models <= 0.1", fontsize=9)
    ax.legend(fontsize=8, loc="lower right", ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--families", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--prompts", type=int, default=64, help="embedded model's prompts")
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot of an existing result file")
    ap.add_argument("--ablation-prompts", type=int, default=16,
                    help="the embedded model with fp8 on parts of it, over this many prompts (0: none)")
    ap.add_argument("--ablation-only", action="store_true", help="add the ablation to an existing result file")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"fp8_accuracy_{args.label}.json")
    if args.plot_only or args.ablation_only:
        with open(path) as f:
            result = json.load(f)
        if args.ablation_only:
            result["ablation"] = ablation(*embedded_sequences(args.ablation_prompts))
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
        plot(result, path.removesuffix(".json") + ".png")
        return
    result = {"label": args.label, "host": platform.node(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "reference": "float32 (CPU)",
              "variants": list(VARIANTS), "rows": []}

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    if not args.skip_embedded:
        seqs, first = embedded_sequences(args.prompts)
        result["rows"].append(bench_model("smollm2-135m", resolve_model("smollm2-135m"), seqs, first))
        if args.ablation_prompts:
            result["ablation"] = ablation(seqs[:args.ablation_prompts], first[:args.ablation_prompts])
        save()
    root = Path(tempfile.mkdtemp(prefix="fp8-acc-"))
    for name in args.families:
        model_dir, _ = build_hf(name, root, initializer_range=0.02)
        lengths = CASES[name][2]
        seqs = prompts(lengths, seed=1) + prompts(lengths, seed=2) + prompts(lengths[:2], seed=3)
        result["rows"].append(bench_model(f"tiny-{name}", resolve_model(model_dir), seqs, [1] * len(seqs)))
        save()
    plot(result, path.removesuffix(".json") + ".png")
    print(f"wrote {path} and its .png")


if __name__ == "__main__":
    main()
