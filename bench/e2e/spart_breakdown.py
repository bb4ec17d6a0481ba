"""Where a CPU S-worker's decode step goes: GEMMs, elementwise passes, sampler, attention, and the
rest (Python, scheduler, hand-offs), before and after the CPU defaults changed.

The embedded model in local mode, 64 chat prompts decoding together (bench/e2e/generate_bench.py's
texts), greedy, EOS ignored. Each configuration builds its engine, runs a warm-up batch, then
decodes the measured batch under torch.profiler (CPU ops, self time): GEMM ops (linear, mm,
addmm, mkldnn), elementwise ops (norms, RoPE, activation, residual adds, casts, copies), the
sampler's ops (argmax, softmax, top-k, gathers), prompt attention (SDPA, in prefill), other torch
ops. The engine's step rows give the R-part's attention (in local mode the C++ kernels run outside
torch's ops) and the decode wall; what is left of the wall is Python, scheduling and hand-offs.
The profiler's own cost lands in that rest, so a configuration is also timed without it.

    python3 bench/e2e/spart_breakdown.py [--label NAME] [--prompts 64] [--new-tokens 64]

Writes bench/e2e/results/spart_breakdown_<label>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))       # this checkout's packages
sys.path.insert(0, HERE)

from generate_bench import prompts  # noqa: E402

# (label, LLM keyword arguments): the defaults before this change and after it
CONFIGS = [
    ("before: float32, depth 2", dict(dtype="float32", pipeline_depth=2)),
    ("bfloat16, depth 2", dict(dtype="bfloat16", pipeline_depth=2)),
    ("after: defaults (bfloat16, depth 1)", dict()),
    ("defaults + --compile", dict(compile=True)),
]
GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "aten::_mkl")
SAMPLER = ("aten::argmax", "aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::topk", "aten::sort",
           "aten::gather", "aten::multinomial", "aten::max", "aten::exponential_")
ATTENTION = ("scaled_dot_product", "flash_attention")
ELEMENTWISE = ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::silu", "aten::cat",
               "aten::neg", "aten::to", "aten::_to_copy", "aten::copy_", "aten::sub", "aten::div", "aten::tanh",
               "aten::gelu", "aten::slice", "aten::index", "aten::embedding", "Torch-Compiled Region",
               "CompiledFunction", "inductor", "aten::empty_strided", "aten::clone", "aten::contiguous")


def category(name: str) -> str:
    for label, keys in (("gemm", GEMM), ("sampler", SAMPLER), ("prompt_attention", ATTENTION),
                        ("elementwise", ELEMENTWISE)):
        if any(name.startswith(k) or k in name for k in keys):
            return label
    return "other_torch"


def run(kwargs: dict, texts: list[str], new_tokens: int, profile: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from fastdecode import LLM, SamplingParams
    llm = LLM("smollm2-135m", quiet=True, max_batch=len(texts), **kwargs)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(texts[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    rec = llm.engine.recorder
    before = (rec.decode_s, rec.s_busy, rec.r_busy, rec.num_decode)
    t0 = time.perf_counter()
    if profile:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(texts, greedy, use_tqdm=False)
    else:
        llm.generate(texts, greedy, use_tqdm=False)
    wall = time.perf_counter() - t0
    decode_s, s_busy, r_busy, steps = (a - b for a, b in zip((rec.decode_s, rec.s_busy, rec.r_busy, rec.num_decode),
                                                             before))
    out = {"args": kwargs, "dtype": str(llm.engine.dtype).removeprefix("torch."),
           "pipeline_depth": llm.engine.args.pipeline_depth, "compiled": llm.engine.model.compiled is not None,
           "torch_threads": torch.get_num_threads(), "wall_s": round(wall, 3),
           "output_tokens_per_s": round(len(texts) * new_tokens / wall, 1), "decode_steps": steps,
           "decode_s": round(decode_s, 3), "decode_step_ms": round(1e3 * decode_s / max(steps, 1), 2),
           "s_busy_s": round(s_busy, 3), "r_part_s": round(r_busy, 3)}
    if profile:
        cats: dict[str, float] = {}
        for ev in prof.key_averages():
            cats[category(ev.key)] = cats.get(category(ev.key), 0.0) + ev.self_cpu_time_total / 1e6
        # self times are summed over threads: one op on T threads counts once (the calling thread's)
        ops = sum(cats.values())
        out["torch_ops_s"] = {k: round(v, 3) for k, v in sorted(cats.items())}
        out["r_part_attention_s"] = round(r_busy, 3)
        out["rest_s"] = round(wall - ops - r_busy, 3)       # Python, scheduler, hand-offs, the profiler
        out["shares_of_wall"] = {k: round(v / wall, 3) for k, v in
                                 {**cats, "r_part_attention": r_busy, "rest": wall - ops - r_busy}.items()}
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default=platform.node() or "host")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    texts = prompts(args.prompts)
    result = {"label": args.label, "cpu": cpu_name(), "cores": os.cpu_count(), "model": "smollm2-135m (local mode)",
              "prompts": args.prompts, "new_tokens": args.new_tokens, "runs": []}
    for label, kwargs in CONFIGS:
        timed = run(kwargs, texts, args.new_tokens, profile=False)
        profiled = run(kwargs, texts, args.new_tokens, profile=True)
        row = {"config": label, "unprofiled": timed, "profiled": profiled}
        result["runs"].append(row)
        print(f"{label:40s} {timed['output_tokens_per_s']:8.1f} tok/s  step {timed['decode_step_ms']:6.1f} ms  "
              f"shares {profiled['shares_of_wall']}", flush=True)
    base = result["runs"][0]["unprofiled"]["output_tokens_per_s"]
    for row in result["runs"]:
        row["x_before"] = round(row["unprofiled"]["output_tokens_per_s"] / base, 3)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"spart_breakdown_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        with open("/proc/cpuinfo") as f:
            amx = "amx_bf16" in f.read()
        return f"{name} ({'AMX' if amx else 'no AMX'})"
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
