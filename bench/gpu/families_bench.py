"""The S-part per layer of each served model family against the pure GEMMs of the same layer.

Per family (published shapes: the HF config.json values below) one decoder layer with random
weights, built without a download and without an HF model in memory: the parameter names and
shapes come from transformers' model class built on the meta device, each is filled with
N(0, 0.02) (norms near 1, Gemma's (1 + w) norms near 0) in the bench dtype on the device, and
`SPart` takes them as a checkpoint's. The embedding and LM head are 16-row stand-ins: the bench
times one layer, and a full vocabulary would cost gigabytes.

Per batch B (rows = sequences in one decode step), same run, interleaved rounds (medians; the
fastest rounds' ratio too):
- ours: `qkv_proj` + `rope_split` + `post_attn` of the layer, the attention output o a random
  [B, Hq, D] (what the R-workers return), the MoE routing included;
- pure: the layer's GEMMs alone as torch matmuls at the same shapes: QKV, O, and gate/up, down
  (dense), or the router, Qwen2-MoE's shared expert and its gate, and each expert's gate/up and
  down over its slice of a uniform routing of B*k rows (one GEMM per expert, no sort, gather or
  scatter);
- MoE layers also: pure_routed, the same GEMMs over the rows per expert that ours' routing of
  these rows gives (a uniform routing touches every expert once B*k >= E, a random one fewer:
  at small B the weights read differ), on a CUDA bf16 device pure_grouped, pure_routed with the
  experts as two grouped GEMMs, and moe, the routed MLP alone (ours), for its share of ours.
Reported: ms per layer, ours / each peer, GFLOP/s of each (the pure GEMMs' FLOPs over its time),
the experts ours' routing reaches and its busiest expert's load.

    python3 bench/gpu/families_bench.py --label devbox-2core-xeon --device cpu --dtype bfloat16 \
        --batches 16 128 512 --repeats 7
    bench/gpu_box.sh setup families                   # on the GPU box: --device cuda --batches 1024 8192
"""
from __future__ import annotations

import argparse
import gc
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

from fastdecode.model.config import config_from_hf_dict  # noqa: E402
from fastdecode.model.spart import SPart  # noqa: E402

# HF config.json values of the published models (text only; only what shapes the layer and the
# fields our reader takes; num_hidden_layers as published, the bench builds 1)
FAMILIES = {
    "llama-3-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001},
    "llama-3-70b": {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001},
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen1.5-moe-a2.7b": {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_hidden_layers": 24, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 8192, "hidden_act": "silu", "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 21, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643},
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 32768,
        "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2},
    "gemma-2-9b": {
        "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "num_hidden_layers": 42, "vocab_size": 256000,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1},
    "gemma-3-12b": {
        "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "num_hidden_layers": 48, "vocab_size": 262208,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1},
    "phi-3-mini": {
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "rope_scaling": None, "sliding_window": 2047, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 32000},
}
STAND_IN_ROWS = 16       # rows of the embedding / LM head stand-ins


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape of the model `cfg` describes, from its class on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    hf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def random_weights(shapes: dict, gemma: bool, dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """N(0, 0.02) for every parameter, made in `dtype` on `device` (no float32 copy of the experts);
    norms 1 + N(0, 0.02) (Gemma's (1 + w): N(0, 0.02)); embedding and LM head as stand-ins."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = {}
    for name, shape in shapes.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shape = (STAND_IN_ROWS, shape[1])
        t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        if len(shape) == 1 and "norm" in name and not gemma:
            t += 1.0
        w[name] = t
    return w


def uniform_counts(rows: int, experts: int) -> list[int]:
    """Rows per expert of `rows` routed rows spread as evenly as they go."""
    base, extra = divmod(rows, experts)
    return [base + (e < extra) for e in range(experts)]


def routed_counts(m: SPart, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The routed MLP's input in `post_attn(0, x, o)` (captured) and the rows per expert its routing gives."""
    L = m.layers[0]
    moe, seen = L["mlp"], []
    L["mlp"] = lambda h: seen.append(h) or moe(h)
    try:
        m.post_attn(0, x, o)
    finally:
        L["mlp"] = moe
    experts = moe.route(seen[0])[1].reshape(-1)
    return seen[0], torch.bincount(experts, minlength=m.config.num_experts).tolist()


def grouped_mm():
    """torch's grouped GEMM (the public name in newer torch, the private one before), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def pure_layer(m: SPart, batch: int, counts: list[int] | None = None, grouped: bool = False):
    """The layer's GEMMs alone at batch B as one callable, and their FLOPs. MoE: each expert's
    GEMMs over counts[e] rows (None: a uniform routing), one GEMM per expert, or with `grouped`
    two grouped GEMMs over all experts (CUDA bf16)."""
    c, L = m.config, m.layers[0]
    dev, dt, h = m.device, m.dtype, c.hidden_size

    def rnd(*shape):
        return torch.randn(*shape, device=dev).to(dt)
    x, o = rnd(batch, h), rnd(batch, c.q_size)
    qkv_out = torch.empty(batch, c.q_size + 2 * c.kv_size, device=dev, dtype=dt)
    o_out = torch.empty(batch, h, device=dev, dtype=dt)
    flops = 2 * batch * h * (c.q_size + 2 * c.kv_size) + 2 * batch * c.q_size * h

    def attn():
        torch.matmul(x, L["w_qkv"].t(), out=qkv_out)
        torch.matmul(o, L["w_o"].t(), out=o_out)

    if isinstance(L["mlp"], tuple):
        gate_up, down = L["mlp"]
        act, gu_out = rnd(batch, down.shape[1]), torch.empty(batch, gate_up.shape[0], device=dev, dtype=dt)

        def layer():
            attn()
            torch.matmul(x, gate_up.t(), out=gu_out)
            torch.matmul(act, down.t(), out=o_out)
        return layer, flops + 6 * batch * h * down.shape[1]
    moe, k = L["mlp"], c.num_experts_per_tok
    inter = moe.down.shape[2]
    counts = counts or uniform_counts(batch * k, c.num_experts)
    ends = torch.tensor(counts).cumsum(0).tolist()
    slices = [(e, t - n, t) for e, (n, t) in enumerate(zip(counts, ends)) if n]
    xs, act = rnd(batch * k, h), rnd(batch * k, inter)
    gu_out, ys = (torch.empty(batch * k, n, device=dev, dtype=dt) for n in (2 * inter, h))
    flops += 2 * batch * h * c.num_experts + 6 * batch * k * h * inter
    if moe.shared_gate_up is not None:
        s_act = rnd(batch, moe.shared_down.shape[1])
        flops += 6 * batch * h * s_act.shape[1] + 2 * batch * h * (moe.shared_gate is not None)

    if grouped:
        mm, offs = grouped_mm(), torch.tensor(ends, device=dev, dtype=torch.int32)   # [E] end rows

        def experts():
            mm(xs, moe.gate_up.transpose(1, 2), offs=offs)
            mm(act, moe.down.transpose(1, 2), offs=offs)
    else:
        def experts():
            for e, s, t in slices:
                torch.matmul(xs[s:t], moe.gate_up[e].t(), out=gu_out[s:t])
            for e, s, t in slices:
                torch.matmul(act[s:t], moe.down[e].t(), out=ys[s:t])

    def layer():
        attn()
        experts()
        F.linear(x, moe.router)
        if moe.shared_gate_up is not None:
            F.linear(x, moe.shared_gate_up)
            F.linear(s_act, moe.shared_down)
            if moe.shared_gate is not None:
                F.linear(x, moe.shared_gate)
    return layer, flops


def timed(fns: dict, device: torch.device, repeats: int, warmup: int = 2) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of each callable, in interleaved rounds (one call of each per round)
    after `warmup` calls of each: a shared host's slow spell hits every variant alike."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return {name: (sorted(ts)[len(ts) // 2], min(ts)) for name, ts in times.items()}


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole host from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(n) for n in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - v[4], sum(v)          # idle and iowait are not busy


def others_cores(start: tuple | None, own_start: float, seconds: float) -> float | None:
    """Cores other processes kept busy on average since `start` (host busy time less ours)."""
    end = cpu_jiffies()
    if start is None or end is None or seconds <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    own = sum(os.times()[:2]) - own_start
    return round(max(0.0, (end[0] - start[0]) / hz - own) / seconds, 2)


def summary(c, full) -> str:
    """The layer's shape, and the published model's attention variants (all its layers)."""
    attn = f"h {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads x {c.head_dim}"
    if c.num_experts:
        mlp = f"{c.num_experts} experts top-{c.num_experts_per_tok} x {c.moe_intermediate_size}"
        if c.shared_expert_intermediate_size:
            mlp += f" + shared {c.shared_expert_intermediate_size}"
    else:
        mlp = f"MLP {c.intermediate_size} ({c.hidden_act})"
    variants = full.attention_variants()
    return f"{attn}; {mlp}" + (f"; {variants}" if variants else "")


def bench_family(name: str, published: dict, args, device: torch.device, dtype) -> list[dict]:
    full = config_from_hf_dict(published, name)             # the published config parses as is
    one = dict(published, num_hidden_layers=1)
    c = config_from_hf_dict(one, name + " (1 layer)")
    t0 = time.perf_counter()
    weights = random_weights(hf_shapes(one), c.gemma_norms, dtype, device)
    m = SPart(c, weights, device, dtype)
    del weights
    print(f"{name}: {summary(c, full)}; built in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = [measure(m, name, full, batch, args.repeats) for batch in args.batches]
    del m
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def measure(m: SPart, name: str, full, batch: int, repeats: int) -> dict:
    """One row: ours against its pure peers at batch B, same run."""
    c, L, device, dtype = m.config, m.layers[0], m.device, m.dtype
    g = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, c.hidden_size, device=device, generator=g).to(dtype)
    o = torch.randn(batch, c.num_heads, c.head_dim, device=device, generator=g).to(dtype)
    positions = torch.randint(0, min(c.max_position, 4096), (batch,), device=device, generator=g)
    rope = m.rope.cos_sin(positions, int(positions.max()))

    def ours():
        m.rope_split(0, m.qkv_proj(0, x), rope)
        return m.post_attn(0, x, o)
    pure, flops = pure_layer(m, batch)
    fns = {"ours": ours, "pure": pure}
    if c.num_experts:
        h, counts = routed_counts(m, x, o)
        fns["moe"] = lambda: L["mlp"](h)
        fns["pure_routed"] = pure_layer(m, batch, counts)[0]
        if grouped_mm() is not None and device.type == "cuda" and dtype == torch.bfloat16:
            fns["pure_grouped"] = pure_layer(m, batch, counts, grouped=True)[0]
    best = timed(fns, device, repeats)
    t = {k: med for k, (med, _) in best.items()}
    row = {"family": name, "model_type": c.model_type, "layers": full.num_layers, "shape": summary(c, full),
           "layer_mib": round(sum(w.numel() * w.element_size() for w in _layer_tensors(L)) / 2**20, 1),
           "batch": batch, "ours_ms": round(t["ours"] * 1e3, 3), "pure_ms": round(t["pure"] * 1e3, 3),
           "ratio": round(t["ours"] / t["pure"], 3), "ratio_of_mins": round(best["ours"][1] / best["pure"][1], 3),
           "pure_gflop": round(flops / 1e9, 3), "ours_gflops": round(flops / t["ours"] / 1e9, 1),
           "pure_gflops": round(flops / t["pure"] / 1e9, 1)}
    if c.num_experts:
        row.update(moe_ms=round(t["moe"] * 1e3, 3), moe_share=round(t["moe"] / t["ours"], 3),
                   experts_busy=sum(n > 0 for n in counts),
                   experts_busy_uniform=min(c.num_experts, batch * c.num_experts_per_tok),
                   busiest_expert_load=round(max(counts) * c.num_experts / sum(counts), 2),
                   pure_routed_ms=round(t["pure_routed"] * 1e3, 3), ratio_routed=round(t["ours"] / t["pure_routed"], 3))
    if "pure_grouped" in t:
        row.update(pure_grouped_ms=round(t["pure_grouped"] * 1e3, 3),
                   ratio_grouped=round(t["ours"] / t["pure_grouped"], 3))
    print("  " + json.dumps({k: v for k, v in row.items() if k not in ("family", "shape", "model_type")}), flush=True)
    return row


def _layer_tensors(L: dict):
    """The tensors of one layer's weights (the MoE's stacked experts included)."""
    for v in L.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, tuple):
            yield from (t for t in v if isinstance(t, torch.Tensor))
        elif v is not None:
            yield from (t for t in vars(v).values() if isinstance(t, torch.Tensor))


def print_table(rows: list[dict]) -> None:
    print(f"\n{'family':<18} {'B':>6} {'ours ms':>9} {'pure ms':>9} {'ours/pure':>9} {'ours GF/s':>9} "
          f"{'pure GF/s':>9} {'MoE share':>9} {'x routed':>8} {'min/min':>8}")
    for r in rows:
        share = f"{r['moe_share']:.0%}" if "moe_share" in r else "-"
        routed = f"{r['ratio_routed']:.2f}x" if "ratio_routed" in r else "-"
        print(f"{r['family']:<18} {r['batch']:>6} {r['ours_ms']:>9.2f} {r['pure_ms']:>9.2f} {r['ratio']:>8.2f}x "
              f"{r['ours_gflops']:>9.0f} {r['pure_gflops']:>9.0f} {share:>9} {routed:>8} {r['ratio_of_mins']:>7.2f}x")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    families = list(dict.fromkeys(r["family"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(batches)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for j, b in enumerate(batches):
        ratio = {r["family"]: r["ratio"] for r in rows if r["batch"] == b}
        xs = [i + (j - (len(batches) - 1) / 2) * width for i in range(len(families))]
        bars = ax.bar(xs, [ratio.get(f, 0) for f in families], width, label=f"B = {b}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        routed = {r["family"]: r["ratio_routed"] for r in rows if r["batch"] == b and "ratio_routed" in r}
        pts = [(xx, routed[f]) for xx, f in zip(xs, families) if f in routed]
        if pts:
            ax.plot(*zip(*pts), "k_", markersize=12, mew=2, label="MoE: against pure_routed" if j == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(families)), families, rotation=20, ha="right")
    ax.set_ylabel("S-part layer / its pure GEMMs (uniform routing)")
    ax.set_title(f"S-part per layer against the pure GEMMs, {result['machine']}, {result['dtype']}, "
                 f"{result['threads']} threads", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


NOTE = ("one decoder layer per family, random weights (published shapes); ours = qkv_proj + rope_split + "
        "post_attn (attention output given, MoE routing included); pure = the layer's GEMMs alone as torch "
        "matmuls (MoE: router, shared expert, one GEMM per expert over a uniform routing of B*k rows); "
        "pure_routed = the same over the rows per expert of ours' routing; pure_grouped = pure_routed with the "
        "experts as two grouped GEMMs (CUDA bf16); gflops = the pure GEMMs' FLOPs over each time; medians of "
        "interleaved rounds, ratio_of_mins = the fastest round of ours / of pure; moe_share = the routed MLP "
        "alone / ours; experts_busy = experts with rows under ours' routing (uniform: min(E, B*k)); "
        "busiest_expert_load = its busiest expert's rows / the mean; other_processes_cores = cores the host's "
        "other processes kept busy during the run")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    t0, jiffies, own = time.perf_counter(), cpu_jiffies(), sum(os.times()[:2])
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"families_{args.label}")
    result = {"label": args.label, "device": str(device), "machine": machine(device), "dtype": args.dtype,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "repeats": args.repeats, "note": NOTE, "rows": []}
    with torch.inference_mode():
        for name in args.families:      # written after every family: a cut run keeps what it finished
            result["rows"] += bench_family(name, FAMILIES[name], args, device, dtype)
            seconds = time.perf_counter() - t0
            result["seconds"] = round(seconds, 1)
            result["other_processes_cores"] = others_cores(jiffies, own, seconds) if device.type == "cpu" else None
            with open(path + ".json", "w") as f:
                json.dump(result, f, indent=1)
    plot(result, path + ".png")
    print_table(result["rows"])
    print(f"\n{path}.json, .png ({seconds:.0f} s; other processes kept {result['other_processes_cores']} cores busy)")

if __name__ == "__main__":
    main()
