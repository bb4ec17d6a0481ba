"""Llama-3-70B's decoder layer with fp8 weights against bf16, on the card, same run.

One layer of the published shape (h 8192, 64/8 heads x 128, MLP 28672) with random weights
N(0, 0.02) in bf16 on the device, and the same weights quantized to e4m3 per output channel
(`--quantization fp8`, fastdecode/model/fp8.py). Per batch B (rows = sequences in one decode
step), interleaved rounds (medians):
- layer_bf16 / layer_fp8: the S-part's dense work of the layer, `qkv_proj` + `rope_split` +
  `post_attn` with a random attention output, as families_bench.py times it; fp8 on the path the
  probe picked (fp8_gemm.py), and again with the activations quantized by the torch code
  (`layer_fp8_torch_quant`) where the probe picked the Triton pass;
- gemm_bf16 / gemm_fp8: the layer's four GEMMs alone (QKV, O, gate/up, down): bf16 matmuls, and
  `torch._scaled_mm` on activations already in e4m3 (the fp8 GEMMs' own time; on CUDA also with
  `use_fast_accum`, which fastdecode does not use: for what it would give);
- quant: the four per-token quantizations of the GEMMs' inputs alone.
Reported: ms each, `speedup_layer` = layer_bf16 / layer_fp8 (the issue's target: >= 1.6 at B =
1,024 and 8,192), `speedup_gemm`, the quantization's share of the fp8 layer, TFLOP/s of the
GEMMs, and the fp8 layer's output against the bf16 layer's (relative Frobenius error: the
quantization's effect on one layer of random weights).

    bench/gpu_box.sh setup fp8layer          # on the GPU box: --batches 1024 8192
    python3 bench/gpu/fp8_layer_bench.py --label cpu-smoke --device cpu --dtype float32 --scale 8 \\
        --batches 16 --repeats 2 --force rowwise --out-dir /tmp      # the code paths on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed
sys.path.insert(0, HERE)

from families_bench import FAMILIES, machine, timed

from fastdecode.model import fp8_gemm
from fastdecode.model.config import config_from_hf_dict
from fastdecode.model.fp8 import Fp8Weight
from fastdecode.model.quantization import is_projection
from fastdecode.model.spart import SPart
from fastdecode.model.weights import random_weights

STAND_IN_VOCAB = 16      # the embedding and LM head: stand-ins, the bench times one layer


def layer_config(scale: int):
    """Llama-3-70B's config with one layer (dims divided by `scale` for a CPU smoke run)."""
    cfg = dict(FAMILIES["llama-3-70b"], num_hidden_layers=1, vocab_size=STAND_IN_VOCAB)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
        cfg[key] //= scale
    cfg["num_key_value_heads"] = max(1, cfg["num_key_value_heads"] // scale)
    cfg["head_dim"] = 128
    return config_from_hf_dict(cfg, "llama-3-70b (1 layer)")


def gemm_fns(m16: SPart, m8: SPart, batch: int, path: fp8_gemm.Fp8Path):
    """The four GEMMs alone in bf16 and in fp8 (inputs pre-quantized), and the quantizations alone."""
    dev, dt = m16.device, m16.dtype
    L16, L8 = m16.layers[0], m8.layers[0]
    gate_up16, down16 = L16["mlp"]
    gate_up8, down8 = L8["mlp"]
    ws16 = [L16["w_qkv"], L16["w_o"], gate_up16, down16]
    ws8 = [L8["w_qkv"], L8["w_o"], gate_up8, down8]
    g = torch.Generator(device=dev).manual_seed(batch)
    xs = [torch.randn(batch, w.shape[1], device=dev, generator=g).to(dt) for w in ws16]
    quantized = [fp8_gemm.quantize_tokens(x, None, path.triton_quant) for x in xs]
    outs = [torch.empty(batch, w.shape[0], device=dev, dtype=dt) for w in ws16]

    def bf16():
        for x, w, o in zip(xs, ws16, outs):
            torch.matmul(x, w.t(), out=o)

    def fp8(fast_accum=False):
        for (xq, s), w in zip(quantized, ws8):
            torch._scaled_mm(xq, w.q.t(), scale_a=s, scale_b=w.scale.unsqueeze(0), out_dtype=dt,
                             use_fast_accum=fast_accum)

    def quant():
        for x in xs:
            fp8_gemm.quantize_tokens(x, None, path.triton_quant)
    flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in ws16)
    fns = {"gemm_bf16": bf16, "gemm_fp8": fp8, "quant": quant}
    if dev.type == "cuda":       # Hopper's faster fp8 accumulation (fewer promotions to fp32): for comparison
        fns["gemm_fp8_fast_accum"] = lambda: fp8(True)
    return fns, flops


def measure(m16: SPart, m8: SPart, batch: int, repeats: int, path: fp8_gemm.Fp8Path) -> dict:
    c, dev, dt = m16.config, m16.device, m16.dtype
    g = torch.Generator(device=dev).manual_seed(batch)
    x = torch.randn(batch, c.hidden_size, device=dev, generator=g).to(dt)
    o = torch.randn(batch, c.num_heads, c.head_dim, device=dev, generator=g).to(dt)
    positions = torch.randint(0, 4096, (batch,), device=dev, generator=g)
    rope = m16.rope.cos_sin(positions, int(positions.max()))

    def layer(m):
        def run():
            m.rope_split(0, m.qkv_proj(0, x), rope)
            return m.post_attn(0, x, o)
        return run
    fns = {"layer_bf16": layer(m16), "layer_fp8": layer(m8)}
    torch_quant = fp8_gemm.Fp8Path(path.kind, path.why, False, path.pad_rows)
    if path.triton_quant:
        def fp8_torch_quant():
            with fp8_gemm.forced_path(torch_quant):
                return layer(m8)()
        fns["layer_fp8_torch_quant"] = fp8_torch_quant
    fp8_only = path.scaled_mm
    if fp8_only:
        more, flops = gemm_fns(m16, m8, batch, path)
        fns.update(more)
    with fp8_gemm.forced_path(path):
        t = {k: med for k, (med, _) in timed(fns, dev, repeats).items()}
        y16, y8 = fns["layer_bf16"]().float(), fns["layer_fp8"]().float()
    row = {"batch": batch, **{f"{k}_ms": round(v * 1e3, 3) for k, v in t.items()},
           "speedup_layer": round(t["layer_bf16"] / t["layer_fp8"], 3),
           "layer_rel_error": round(float((y8 - y16).norm() / (y16 - x.float()).norm()), 5)}
    if "gemm_fp8_fast_accum" in t:
        row["speedup_gemm_fast_accum"] = round(t["gemm_bf16"] / t["gemm_fp8_fast_accum"], 3)
    if fp8_only:
        row.update(speedup_gemm=round(t["gemm_bf16"] / t["gemm_fp8"], 3),
                   quant_share=round(t["quant"] / t["layer_fp8"], 3),
                   gemm_bf16_tflops=round(flops / t["gemm_bf16"] / 1e12, 1),
                   gemm_fp8_tflops=round(flops / t["gemm_fp8"] / 1e12, 1))
    if "layer_fp8_torch_quant" in t:
        row["speedup_layer_torch_quant"] = round(t["layer_bf16"] / t["layer_fp8_torch_quant"], 3)
    print("  " + json.dumps(row), flush=True)
    return row


NOTE = ("one Llama-3-70B decoder layer (h 8192, 64/8 heads x 128, MLP 28672), random N(0, 0.02) weights; layer = "
        "qkv_proj + rope_split + post_attn of the S-part (attention output given), bf16 weights against the same "
        "weights in e4m3 with per-output-channel scales; gemm = the 4 GEMMs alone (fp8: torch._scaled_mm on inputs "
        "already quantized); quant = the 4 per-token quantizations alone; layer_rel_error = |fp8 - bf16| / |bf16 "
        "layer's update of x| (Frobenius); medians of interleaved rounds")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--scale", type=int, default=1, help="divide the layer's dims (a CPU smoke run)")
    ap.add_argument("--force", choices=("rowwise", "tensorwise", "dequant"),
                    help="this fp8 path instead of the probe's (a CPU smoke run: rowwise)")
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    t0 = time.perf_counter()
    c = layer_config(args.scale)
    with torch.inference_mode():
        w = random_weights(c, dtype, device)
        m16 = SPart(c, w, device, dtype)
        m8 = SPart(c, {k: Fp8Weight.quantize(v) if is_projection(k) else v for k, v in w.items()}, device, dtype)
        del w
        path = fp8_gemm.Fp8Path(args.force, "forced") if args.force else m8.fp8_path
        print(f"fp8 path on {device}: {path}; built in {time.perf_counter() - t0:.1f} s", flush=True)
        os.makedirs(args.out_dir, exist_ok=True)
        out = os.path.join(args.out_dir, f"fp8_layer_{args.label}.json")
        result = {"label": args.label, "device": str(device), "machine": machine(device), "dtype": args.dtype,
                  "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
                  "scale": args.scale, "fp8_path": path.describe(dtype), "fp8_path_kind": path.kind,
                  "note": NOTE, "rows": []}
        for batch in args.batches:       # written after every batch: a cut run keeps what it finished
            result["rows"].append(measure(m16, m8, batch, args.repeats, path))
            result["seconds"] = round(time.perf_counter() - t0, 1)
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    print(f"{out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
