"""S-worker overhead at huge batch: our S-part per layer vs the pure dense layer, same run.

Pure: RMSNorm, fused QKV GEMM, O GEMM, RMSNorm, gate/up GEMM, SiLU*up, down GEMM at batch B
(the anchor's s_part, DESIGN.md §5). Ours: the engine's real decode step (ModelRunner.decode:
embedding, RoPE, the layers, LM head, sampling) at depth 1 and 2 with a loopback R-part that
does all the S-worker's transport work (pack Q/K/V, device->host copy into pinned buffers on the
side stream, host->device copy of O) but no attention, so only S-worker time is measured.
Reports ms per layer (step time less the LM head + sampling, / layers) and the ratio to pure.

    python bench/s_overhead_bench.py --label h100-box --model random:llama-2-7b:layers=4 --batches 1024 4096 16384
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from fastdecode.engine import EngineArgs, LLMEngine
from fastdecode.profile import fake_sequences, median_time
from fastdecode.rpart.loopback import LoopbackBackend
from fastdecode.runner import ModelRunner
from fastdecode.sampling_params import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pure_layer(config, dtype, device, batch, repeats):
    """The anchor's dense layer at batch B (no RoPE, no transport, no Python per mini-batch)."""
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
    ap.add_argument("--model", default="random:llama-2-7b:layers=4")
    ap.add_argument("--batches", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, kv_dtype="bf16", max_batch=1 << 20))
    m, c = engine.model, engine.config
    loop = LoopbackBackend(c.num_heads, c.head_dim, m.device, m.dtype)
    rows = []
    for batch in args.batches:
        seqs = fake_sequences(batch, 64, c.vocab_size)
        pure = pure_layer(c, m.dtype, m.device, batch, args.repeats)
        x = torch.randn(batch, c.hidden_size, device=m.device).to(m.dtype)
        from fastdecode.sampler import SamplingBatch, sample
        head_rows = SamplingBatch([(SamplingParams(temperature=0), 0, 0, 0, None)] * batch, m.device)
        head = median_time(lambda: sample(m.logits(x), head_rows), m.device, args.repeats)
        row = {"batch": batch, "pure_layer_ms": round(pure * 1e3, 4), "head_ms": round(head * 1e3, 3)}
        for depth in (1, 2):
            runner = ModelRunner(m, loop, engine.eos_ids, depth)
            step = median_time(lambda: runner.decode(seqs), m.device, args.repeats)
            per_layer = (step - head) / c.num_layers
            row[f"depth{depth}_step_ms"] = round(step * 1e3, 3)
            row[f"depth{depth}_layer_ms"] = round(per_layer * 1e3, 4)
            row[f"depth{depth}_ratio_to_pure"] = round(per_layer / pure, 3)
        rows.append(row)
        print(row, flush=True)
    result = {"label": args.label, "model": args.model, "device": str(m.device),
              "gpu": torch.cuda.get_device_name() if m.device.type == "cuda" else None,
              "dtype": str(m.dtype), "layers": c.num_layers, "rows": rows,
              "note": "ratio = (decode step - LM head/sampling) / layers / pure dense layer, same run"}
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", f"s_overhead_{args.label}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
