"""S-worker overhead at huge batch: our S-part per layer vs the pure dense layer, same run.

Pure: RMSNorm, fused QKV GEMM, O GEMM, RMSNorm, gate/up GEMM, SiLU*up, down GEMM at batch B
(the layer behind the H100 per-layer times in docs/design.md, "The sizing model"). Ours: the
engine's real decode step (ModelRunner.decode: embedding, RoPE, the layers, LM head, sampling)
at depth 1 and 2 with a loopback R-part that does all the S-worker's transport work (Q/K/V
packed in the wire layout, device->host into pinned buffers on the D2H stream, O host->device on
the H2D stream) but no attention, so only S-worker time is measured. Per layer = the slope of the step time between the model's first L/2
and all L layers ((step_L - step_L/2) / (L/2)), so the per-step costs (embedding, the host's
per-sequence bookkeeping, pipeline fill and drain, LM head, sampling) fall out; they are reported
apart as `step_fixed_ms`. Ratios to the pure layer; with the fused kernels (ops.py), with them
replayed from CUDA graphs (model/layer_graphs.py), and with the torch code.

The other physical limit, measured in the same run: the PCIe copies. Per layer the S-worker must
move (Hq + 2 Hkv)·D·B activations to the host and Hq·D·B back; at the pinned copy bandwidths
measured here (both directions at once) that is `pcie_layer_ms`, so no schedule can beat
max(pure, pcie) per layer (`floor_layer_ms`).

    python3 bench/gpu/s_overhead_bench.py --label h100-box --model random:llama-2-7b:layers=8 --batches 1024 4096 16384
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed

from fastdecode.engine.args import EngineArgs  # noqa: E402
from fastdecode.engine.harness import fake_sequences, first_layers, median_time  # noqa: E402
from fastdecode.engine.llm_engine import LLMEngine  # noqa: E402
from fastdecode.engine.runner import ModelRunner  # noqa: E402
from fastdecode.engine.sampler import SamplingBatch, sample  # noqa: E402
from fastdecode.engine.sampling_params import SamplingParams  # noqa: E402
from fastdecode.model.layer_graphs import LayerGraphs  # noqa: E402
from fastdecode.model.ops import SPartOps  # noqa: E402
from fastdecode.rpart.loopback import LoopbackBackend  # noqa: E402
from fastdecode.sizing.measure import pcie_bandwidth  # noqa: E402


def pure_layer(config, dtype, device, batch, repeats):
    """The pure dense layer at batch B (no RoPE, no transport, no Python per mini-batch)."""
    h, inter = config.hidden_size, config.intermediate_size
    g = torch.Generator(device=device).manual_seed(0)
    w_qkv = torch.randn(config.q_size + 2 * config.kv_size, h, device=device, generator=g).to(dtype) * 0.02
    w_o = torch.randn(h, config.q_size, device=device, generator=g).to(dtype) * 0.02
    w_gu = torch.randn(2 * inter, h, device=device, generator=g).to(dtype) * 0.02
    w_d = torch.randn(h, inter, device=device, generator=g).to(dtype) * 0.02
    x = torch.randn(batch, h, device=device, generator=g).to(dtype)

    def layer():
        hh = F.rms_norm(x, (h,))
        qkv = hh @ w_qkv.T
        y = x + qkv[:, :config.q_size] @ w_o.T
        hh = F.rms_norm(y, (h,))
        gate, up = (hh @ w_gu.T).chunk(2, dim=-1)
        return y + (F.silu(gate) * up) @ w_d.T
    return median_time(layer, device, repeats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default="random:llama-2-7b:layers=8")
    ap.add_argument("--batches", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graphs variant")
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, kv_dtype="bf16", max_batch=1 << 20))
    m, c = engine.model, engine.config
    loop = LoopbackBackend(c.num_heads, c.head_dim, m.device, m.dtype)
    fused_ops = m.ops
    torch_ops = SPartOps(m.device, m.dtype, c.hidden_size)
    torch_ops.tri = None
    variants = [("fused", fused_ops, None)] if fused_ops.fused else []
    if m.device.type == "cuda" and args.graphs:      # fused (or torch) ops replayed from CUDA graphs
        variants.insert(0, ("graphs", fused_ops, LayerGraphs(m, max_rows=max(args.batches))))
    variants.append(("torch", torch_ops, None))
    d2h_bw, h2d_bw = pcie_bandwidth(m.device)
    act_bytes = m.embed.element_size()
    rows = []
    for batch in args.batches:
        seqs = fake_sequences(batch, 64, c.vocab_size)
        pure = pure_layer(c, m.dtype, m.device, batch, args.repeats)
        out_bytes = batch * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * act_bytes
        back_bytes = batch * c.num_heads * c.head_dim * act_bytes
        pcie = max(out_bytes / d2h_bw, back_bytes / h2d_bw) if d2h_bw else 0.0
        x = torch.randn(batch, c.hidden_size, device=m.device).to(m.dtype)
        head_rows = SamplingBatch([(SamplingParams(temperature=0), 0, 0, 0, None)] * batch, m.device)
        head = median_time(lambda: sample(m.logits(x), head_rows), m.device, args.repeats)
        row = {"batch": batch, "pure_layer_ms": round(pure * 1e3, 4), "pcie_layer_ms": round(pcie * 1e3, 4),
               "floor_layer_ms": round(max(pure, pcie) * 1e3, 4), "head_ms": round(head * 1e3, 3)}
        half = c.num_layers // 2
        for name, ops, graphs in variants:
            m.ops = ops
            for depth in args.depths:
                runner = ModelRunner(m, loop, engine.eos_ids, depth, graphs)
                step = median_time(lambda: runner.decode(seqs), m.device, args.repeats)
                with first_layers(m, half):
                    step_half = median_time(lambda: runner.decode(seqs), m.device, args.repeats)
                per_layer = (step - step_half) / (c.num_layers - half)
                key = f"{name}_depth{depth}"
                row[f"{key}_step_ms"] = round(step * 1e3, 3)
                row[f"{key}_step_fixed_ms"] = round((step - c.num_layers * per_layer) * 1e3, 3)
                row[f"{key}_layer_ms"] = round(per_layer * 1e3, 4)
                row[f"{key}_ratio_to_pure"] = round(per_layer / pure, 3)
                row[f"{key}_ratio_to_floor"] = round(per_layer / max(pure, pcie), 3)
        m.ops = fused_ops
        rows.append(row)
        print(row, flush=True)
    result = {"label": args.label, "model": args.model, "device": str(m.device),
              "gpu": torch.cuda.get_device_name() if m.device.type == "cuda" else None,
              "dtype": str(m.dtype), "layers": c.num_layers, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"),
              "pcie_d2h_GBps": round(d2h_bw / 1e9, 2) if d2h_bw else None,
              "pcie_h2d_GBps": round(h2d_bw / 1e9, 2) if h2d_bw else None,
              "rows": rows,
              "note": "layer = (step with all layers - step with the first half) / (layers - half); "
                      "step_fixed = step - layers * layer (embedding, host bookkeeping, fill/drain, LM head, "
                      "sampling); ratio = layer / pure dense layer, same run; "
                      "floor = max(pure layer, PCIe time of the layer's activations at the bandwidths "
                      "measured in this run with both directions busy); fused = Triton kernels, "
                      "torch = the unfused torch code (FASTDECODE_FUSED=0); graphs = fused kernels with each "
                      "mini-batch's post_attn + next QKV projection replayed from a CUDA graph "
                      "(model/layer_graphs.py, captured in the warm-up call)"}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"s_overhead_{args.label}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
