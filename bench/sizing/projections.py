"""Cluster projections through the simulator (`fastdecode simulate`'s engine): what a user would buy.

(a) The published FastDecode setting from stated hardware (bench/sizing/sizing_paper.py's A10,
    EPYC sockets and link, and its fitted attention bandwidth and per-call cost): Llama-7B/13B,
    1-8 sockets, fixed lengths, the stabilized schedule; scaling efficiency against the figures
    published for that setting (72.8%, 84.1%, 37.6%/75.9%) and against the analytic model.
(b) One H100 S-worker with 0 and 4-64 CPU sockets: Llama-3-8B and Llama-3-70B on a chat-like
    workload (prompts ~1k tokens, outputs ending between 128 and 1,024 tokens), Llama-3-8B at 32k
    context and with long generations; tokens/s, per-token latency and tokens/s per dollar. The
    S-worker keeps what its tier holds in the card's memory (the hybrid), so 0 sockets is
    fastdecode as a GPU-only engine, and each socket count is set against it and against GPU-only
    serving on the same H100: HF `generate` measured on the GPU box
    (bench/gpu/results/gpu_only_h100-box.json), the GPU's own memory-bound ceiling for any GPU-only
    engine (KV beside the weights in HBM, each step reading both), and a stated throughput for a
    tuned GPU-only engine (an outside figure, not measured here). Each point runs the best of a few
    batch limits: the batch `plan` (the sizing model) finds best for that many sockets, and 4,096
    and 16,384, at the pipeline depth (1 or 2) `plan` finds best there; and, where none of those
    reaches the card alone, its own batch and depth, so that no socket count runs below it.
All hardware and prices are stated below (assumptions, not measurements); docs/projections.md.

    python3 bench/sizing/projections.py     # writes bench/sizing/results/projections.{json,png}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import sizing_paper as paper  # noqa: E402

from fastdecode.sim.core import SimConfig, simulate  # noqa: E402
from fastdecode.sim.costs import costs_of  # noqa: E402
from fastdecode.sim.report import summary  # noqa: E402
from fastdecode.sim.trace import Trace, synthetic_trace  # noqa: E402
from fastdecode.sizing.hardware import GPU_PRESETS, TIER_ATTN_EFF, stated_profile, stated_tier  # noqa: E402
from fastdecode.sizing.model import predict  # noqa: E402
from fastdecode.sizing.schema import MODEL_PRESETS  # noqa: E402
from fastdecode.sizing.tensor_parallel import TPSizing, stated_tier_over, with_tensor_parallel  # noqa: E402

# ---- (b) stated hardware and prices (assumptions; change them here)
H100 = GPU_PRESETS["h100"]        # 989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB (datasheet)
SOCKET_READ_GBPS = 350.0          # one EPYC 9004-class socket: 12 x DDR5-4800 = 461 GB/s peak, ~76% read
KERNEL_EFF = 0.75                 # attention / read bandwidth: the kernel on the GPU box, Llama-3-8B, ctx 1k-16k
SOCKET_MEM_GB = 384.0             # 12 x 32 GB per socket
LINK_GBPS, LINK_US = 25.0, 3.0    # 200 Gb/s InfiniBand per R-worker node, MPI one-way latency
PCIE_GBPS = 50.0                  # the S-worker's device<->host copies each way (PCIe 5 x16, pinned)
GPU_HOUR, SOCKET_HOUR = 3.00, 1.50  # $ per hour: an H100's share of a GPU node; a socket's share of a CPU node
TUNED_GPU_ONLY_8B = 12500.0       # output tokens/s, a tuned GPU-only engine, Llama-3-8B bf16, one H100, short prompts
PREFILL_TOKENS = 32768            # --max-prefill-tokens (generate's default on a card this size)
# the S-worker's own KV tier: 0.9 of the card less the weights and the activations' reserve at the
# batch limit (generate's default sizing), read at TIER_ATTN_EFF of the bandwidth (assumed: not yet measured)
SOCKETS = [0, 4, 8, 16, 32, 64]
BATCHES = [4096, 16384]
PLAN_SWEEP = sorted({int(round(8 * 1.25 ** i)) for i in range(35)})   # 8 .. 19,722: the batches `plan` weighs
WORKLOADS = {
    "llama-3-8b chat": dict(model="llama-3-8b", prompt="lognormal:1024:0.5", output="uniform:128:1024",
                            max_tokens=1024),
    # bf16 weights (141 GB) fit no 80 GB card: the GPU-only ceiling takes fp8 weights and KV and 95%
    # of the memory; the S-worker would need fp8 weights too (not built: its time is bf16's), and its
    # tier is what fp8 weights would leave in 95% of the card, holding bf16 KV
    "llama-3-70b chat": dict(model="llama-3-70b", prompt="lognormal:1024:0.5", output="uniform:128:1024",
                             max_tokens=1024, gpu_only=dict(weight_bytes=1, kv_bytes=1, usable=0.95)),
    # the S-worker in fp8 over T = 1, 2, 4 H100s of one node (NVLink), each holding 1/T of every
    # layer and its heads' share of the tier (fastdecode/sizing/tensor_parallel.py); T cards' price
    **{f"llama-3-70b chat fp8 T={t}": dict(model="llama-3-70b", prompt="lognormal:1024:0.5",
                                          output="uniform:128:1024", max_tokens=1024, fp8=True, tp=t,
                                          gpu_only=dict(weight_bytes=1, kv_bytes=1, usable=0.95))
       for t in (1, 2, 4)},
    "llama-3-8b 32k": dict(model="llama-3-8b", prompt="uniform:30000:32000", output="uniform:128:512",
                           max_tokens=512),
    # long generation (reasoning traces): contexts grow to 32k while the GPU mostly decodes
    "llama-3-8b 16k+16k": dict(model="llama-3-8b", prompt="uniform:15000:17000", output="uniform:8000:16000",
                               max_tokens=16000, requests=2000, batches=[4096]),
}


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def run_sim(profile, trace: Trace, rworkers: int, max_batch: int, depth: int = 2, schedule: str = "stabilized",
            prefill_tokens: int = 32768) -> dict:
    # span_steps: the steps between two events in closed form (the card alone's small batches at
    # long contexts are millions of steps; within about 1% of stepping each one, tests/test_simulate_spans.py)
    cfg = SimConfig(rworkers=rworkers, depth=depth, schedule=schedule, max_batch=max_batch,
                    max_prefill_tokens=prefill_tokens, span_steps=True)
    run = simulate(costs_of(profile, rworkers, max_batch), trace, cfg)
    return summary(run, trace)


# ---------------------------------------------------------------- (a) the published setting

def paper_setting() -> list[dict]:
    """Efficiency(P) = tokens/s(P) / (P x tokens/s(1)), per point the published figure, the
    analytic model's (sizing_paper.json, bandwidth + per-call cost fitted) and the simulator's
    with the same stated hardware; the fitted values are read from sizing_paper.json."""
    fitted = load_json(os.path.join(RESULTS, "sizing_paper.json"))["fit_bandwidth_and_overhead"]["gen=L"]
    analytic = {(c["model"], c["L"]): c["efficiency"] for c in fitted["cases"]}
    rows = []
    for (model, L), points in paper.PAPER.items():
        prof = stated_profile(paper.GPU, MODEL_PRESETS[model], fitted["attn_GBps_per_socket"], paper.EPYC_MEM_GB,
                              paper.LINK_GBPS, paper.LINK_US, cpu_attn_eff=1.0,
                              call_overhead_us=fitted["call_overhead_us"])
        batch = paper.MAIN_BATCH
        # fixed lengths, as the published runs: a one-token prompt, L generated, 4 batches' worth
        trace = synthetic_trace(4 * batch, "1", str(L))
        tps = {p: run_sim(prof, trace, p, batch, depth=paper.DEPTH)["output_tokens_per_s"] for p in paper.SOCKETS}
        for p in paper.SOCKETS:
            rows.append({"model": model, "L": L, "sockets": p, "tokens_per_s": tps[p],
                         "efficiency_sim": round(tps[p] / (p * tps[1]), 4),
                         "efficiency_analytic": analytic[(model, L)][str(p)],
                         "efficiency_published": points.get(p)})
        print(f"paper {model} L={L}: " + ", ".join(f"{p}: {r['efficiency_sim']:.3f}" for p, r in
                                                   zip(paper.SOCKETS, rows[-len(paper.SOCKETS):])), flush=True)
    return rows


# ---------------------------------------------------------------- (b) one H100 and many sockets

def h100_profile(spec: dict, max_batch: int):
    """The stated H100 with sockets, and its own KV tier as generate would size it at this batch limit."""
    model = MODEL_PRESETS[spec["model"]]
    only = spec.get("gpu_only", {})
    tp = tp_of(spec)
    if tp.active:         # generate's own sizing on each of the T cards: 0.9 of it less its weights
        tier = stated_tier_over(H100, model, tp, max_batch=max_batch, max_prefill_tokens=PREFILL_TOKENS)
    else:
        weights = None if "weight_bytes" not in only else \
            model.weight_bytes() / model.dtype_bytes * only["weight_bytes"]
        tier = stated_tier(H100, model, utilization=only.get("usable", 0.9), weight_bytes=weights,
                           max_batch=max_batch, max_prefill_tokens=PREFILL_TOKENS)
    prof = with_tensor_parallel(stated_profile(H100, model, SOCKET_READ_GBPS, SOCKET_MEM_GB, LINK_GBPS, LINK_US,
                                               cpu_attn_eff=KERNEL_EFF, device_tier=tier), tp, H100)
    prof.link.device_d2h_Bps = prof.link.device_h2d_Bps = PCIE_GBPS * 1e9
    return prof


def tp_of(spec: dict) -> TPSizing:
    """A workload's S-worker: T GPUs over NVLink (stated figures), fp8 weights or the dtype's."""
    return TPSizing(spec.get("tp", 1), spec.get("fp8", False))


def plan_best(prof, sockets: int, mean_prompt: float, mean_output: float) -> tuple[int, int]:
    """(batch, pipeline depth) at which `plan` (the sizing model, the same stated hardware) says this
    many sockets and the tier give the most tokens/s: where the two sides of the step end together,
    or memory. Depth 1 where nothing is left to overlap (the card alone: a second mini-batch only
    repeats the S-part's launch floor)."""
    gen, prompt = max(int(mean_output), 1), int(mean_prompt)
    preds = [predict(prof, b, gen, prompt, rworkers=sockets, depth=d) for b in PLAN_SWEEP for d in (1, 2)]
    best = max(preds, key=lambda p: p.tokens_per_s)
    return best.batch_run, best.pipeline_depth


def gpu_only_ceiling(model: str, mean_prompt: float, mean_output: float, gpu=H100, weight_bytes: float = 2,
                     kv_bytes: float = 2, usable: float = 0.9) -> dict:
    """Any GPU-only engine on one card: weights and KV in its memory (`usable` of it), every decode
    step reads the weights and the running sequences' KV at 80% of the bandwidth, prompts run at
    60% of the peak FLOP/s (their attention left out, as the simulator's stated S-worker does); the
    batch is what the KV of the mean request (prompt + output) leaves room for."""
    m = MODEL_PRESETS[model]
    params = m.num_layers * m.layer_weight_bytes() / m.dtype_bytes + 2 * m.hidden * m.vocab
    weights = params * weight_bytes
    kv_tok = m.kv_bytes_per_token_layer(kv_bytes) * m.num_layers
    free = usable * gpu.mem_GB * 1e9 - weights
    batch = int(max(free, 0) // (kv_tok * (mean_prompt + mean_output)))
    setting = {"gpu": gpu.name, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "usable": usable,
               "weights_GB": round(weights / 1e9, 1)}
    if batch < 1:
        return {**setting, "fits": False, "note": "no sequence's KV fits beside the weights"}
    bw = 0.8 * gpu.mem_bw_GBps * 1e9
    step = (weights + batch * kv_tok * (mean_prompt + mean_output / 2)) / bw
    prefill_per_req = 2 * params * mean_prompt / (0.6 * gpu.peak_tflops * 1e12)
    wall_per_req = step * mean_output / batch + prefill_per_req
    return {**setting, "fits": True, "batch": batch, "decode_tokens_per_s": round(batch / step, 1),
            "output_tokens_per_s": round(mean_output / wall_per_req, 1), "token_latency_s": round(step, 5)}


def h100_point(name: str, spec: dict, sockets: int, trace: Trace, gpu_alone: dict | None = None) -> dict:
    """The best of the batch limits (module docstring) for this many sockets beside the tier: a
    smaller limit leaves the tier more of the card (the activations' reserve shrinks with it).
    gpu_alone: the card alone's row; where no other limit reaches its tokens/s, its own batch and
    depth are run too (a slow point: a small batch is many steps)."""
    mean_prompt, mean_output = float(trace.prompt_len.mean()), float(trace.output_len.mean())
    top = max(spec.get("batches", BATCHES))
    if not sockets and h100_profile(spec, top).device_tier is None:
        return {"workload": name, "sockets": 0, "output_tokens_per_s": None, "batch_limit": None,
                "note": "no KV tier fits beside the weights and the activations: the card alone runs nothing"}
    batch, depth = plan_best(h100_profile(spec, top), sockets, mean_prompt, mean_output)
    # (limit, depth): plan's best, and the larger limits at its depth
    candidates = sorted({(batch, depth)} | {(b, depth) for b in spec.get("batches", BATCHES)})
    if gpu_alone:
        candidates.append((gpu_alone["running_max"], gpu_alone["pipeline_depth"]))
    best, tried, held = None, [], {}
    for i, (batch, depth) in enumerate(candidates):
        if held.get(depth, batch) < batch:
            continue         # memory, not the limit, held a smaller limit's batch: a higher one only shrinks the tier
        if gpu_alone and i == len(candidates) - 1 and best["output_tokens_per_s"] >= gpu_alone["output_tokens_per_s"]:
            break            # the card alone's batch is needed only where nothing else reached it
        tried.append([batch, depth])
        s = run_sim(h100_profile(spec, batch), trace, sockets, batch, depth=depth, prefill_tokens=PREFILL_TOKENS)
        row = {"batch_limit": batch, "pipeline_depth": depth, "output_tokens_per_s": s["output_tokens_per_s"],
               "token_latency_p50_s": s["token_latency_p50_s"], "token_latency_p99_s": s["token_latency_p99_s"],
               "s_utilisation": s["utilisation"]["s_worker"], "r_bubble": s["r_bubble_fraction"],
               "s_bubble": s["s_bubble_fraction"], "bound": s["bound"], "running_mean": s["running_mean"],
               "running_max": s["running_max"], "tier_kv_share": s["tier_kv_share"],
               "tier_utilisation": s["utilisation"]["device_tier"]}
        if s["running_max"] < 0.9 * batch:
            held[depth] = batch
        if best is None or (row["output_tokens_per_s"] or 0) > best["output_tokens_per_s"]:
            best = row
    dollars = tp_of(spec).size * GPU_HOUR + sockets * SOCKET_HOUR
    return {"workload": name, "sockets": sockets, **best, "limits_tried": tried,
            "dollars_per_hour": dollars, "tokens_per_dollar": round(best["output_tokens_per_s"] * 3600 / dollars, 0)}


def h100_cluster(requests: int, only: list[str], sockets: list[int] = SOCKETS) -> dict:
    out = {}
    for name, spec in WORKLOADS.items():
        if only and name not in only:
            continue
        trace = synthetic_trace(spec.get("requests", requests), spec["prompt"], spec["output"], spec["max_tokens"],
                                seed=1)
        rows = []
        for p in sockets:
            alone = rows[0] if rows and not rows[0]["sockets"] and rows[0].get("running_max") else None
            rows.append(h100_point(name, spec, p, trace, alone))
            r = rows[-1]
            print(f"{name} {p} sockets: " + (r.get("note") or f"{r['output_tokens_per_s']:.0f} tok/s (limit "
                  f"{r['batch_limit']}), p50 {r['token_latency_p50_s']:.3f} s, {r['bound']}"), flush=True)
        tier = h100_profile(spec, (not rows[0]["sockets"] and rows[0]["batch_limit"])
                            or max(spec.get("batches", BATCHES))).device_tier
        out[name] = {"spec": spec, "trace_mean_prompt": round(float(trace.prompt_len.mean()), 1),
                     "trace_mean_output": round(float(trace.output_len.mean()), 1),
                     "device_tier_GB": round(tier.capacity_bytes / 1e9, 1) if tier else 0.0,
                     "fastdecode": rows}
    return out


def add_peers(doc: dict) -> None:
    """GPU-only peers (analytic, cheap: recomputed on every run): per H100 workload the ceiling,
    its tokens per dollar and each cluster row's break-even socket price; per published point the
    A10's GPU-only ceiling against the simulated cluster at 8 sockets."""
    for name, w in doc["h100"].items():
        spec = WORKLOADS[name]
        ceiling = gpu_only_ceiling(spec["model"], w["trace_mean_prompt"], w["trace_mean_output"],
                                   **spec.get("gpu_only", {}))
        if ceiling["fits"]:
            ceiling["tokens_per_dollar"] = round(ceiling["output_tokens_per_s"] * 3600 / GPU_HOUR, 0)
        w["gpu_only_ceiling"] = ceiling
        # the card alone: fastdecode as a GPU-only engine (None where nothing fits beside the weights)
        alone = next((r for r in w["fastdecode"] if r["sockets"] == 0), {}).get("output_tokens_per_s")
        peers = {"gpu_alone": alone, "ceiling": ceiling.get("output_tokens_per_s") or 0.0}
        if name == "llama-3-8b chat":
            peers["tuned"] = TUNED_GPU_ONLY_8B
        for row in w["fastdecode"]:
            tps = row["output_tokens_per_s"]
            if tps is None:
                continue
            row["x_ceiling"] = round(tps / peers["ceiling"], 2) if peers["ceiling"] else None
            row["x_gpu_alone"] = round(tps / alone, 2) if alone else None
            if not row["sockets"]:
                continue
            row["break_even_socket_dollars"] = {k: break_even_socket_price(row, v, tp_of(spec).size)
                                                for k, v in peers.items()}
            row["gain_per_socket"] = round((tps - (alone or 0.0)) / row["sockets"], 1)   # tokens/s each socket adds
    doc["paper_gpu_only"] = []
    for (model, L), rows in _group_points(doc["paper_setting"]).items():
        ceiling = gpu_only_ceiling(model, 1, L, gpu=paper.GPU)
        top = max(rows, key=lambda r: r["sockets"])
        doc["paper_gpu_only"].append({"model": model, "L": L, "a10_ceiling": ceiling, "sockets": top["sockets"],
                                      "cluster_tokens_per_s": top["tokens_per_s"],
                                      "x_ceiling": round(top["tokens_per_s"] / ceiling["output_tokens_per_s"], 2)
                                      if ceiling["fits"] else None})


def _group_points(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault((r["model"], r["L"]), []).append(r)
    return out


def break_even_socket_price(row: dict, gpu_only_tps: float, gpus: int = 1) -> float | None:
    """The $ per socket-hour below which the cluster's tokens per dollar (its S-worker on `gpus`
    cards) beat GPU-only's on one card."""
    if not gpu_only_tps:
        return None
    # tps / (T G + P x s) = g / G  =>  s = (tps x G / g - T G) / P
    return round((row["output_tokens_per_s"] * GPU_HOUR / gpu_only_tps - gpus * GPU_HOUR) / row["sockets"], 3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000, help="requests per workload trace")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--only", nargs="+", default=[], choices=list(WORKLOADS),
                    help="rerun these workloads only, keeping the rest of an existing projections.json")
    ap.add_argument("--sockets", type=int, nargs="+", default=SOCKETS,
                    help="socket counts to run (default %(default)s; 0, the card alone, is the slowest point: "
                         "a small batch is many steps)")
    ap.add_argument("--peers", action="store_true",
                    help="recompute the GPU-only peers and the plot of an existing projections.json, no simulation")
    args = ap.parse_args(argv)
    t0 = time.time()
    path = os.path.join(args.out_dir, "projections.json")
    if args.peers:
        doc = load_json(path)
        add_peers(doc)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        plot(doc, os.path.join(args.out_dir, "projections.png"))
        return
    gpu_only = load_json(os.path.join(REPO, "bench", "gpu", "results", "gpu_only_h100-box.json"))
    doc = {"date": time.strftime("%Y-%m-%d"),
           "stated": {"gpu": "h100 preset", "device_tier_attn_eff": TIER_ATTN_EFF,
                      "socket_read_GBps": SOCKET_READ_GBPS, "kernel_eff": KERNEL_EFF,
                      "socket_mem_GB": SOCKET_MEM_GB, "link_GBps": LINK_GBPS, "link_latency_us": LINK_US,
                      "pcie_GBps": PCIE_GBPS, "gpu_dollars_per_hour": GPU_HOUR,
                      "socket_dollars_per_hour": SOCKET_HOUR, "tuned_gpu_only_8b_tokens_per_s": TUNED_GPU_ONLY_8B},
           "paper_setting": [] if args.only else paper_setting(),
           "h100": h100_cluster(args.requests, args.only, args.sockets),
           "hf_generate_measured": [r for r in gpu_only["runs"] if r.get("cache") == "dynamic"]}
    if args.only:       # keep what was not rerun: other workloads, and a rerun workload's other socket counts
        old = load_json(path)
        doc["paper_setting"] = old["paper_setting"]
        for name, w in doc["h100"].items():
            kept = [r for r in old["h100"].get(name, {}).get("fastdecode", []) if r["sockets"] not in args.sockets]
            w["fastdecode"] = sorted(kept + w["fastdecode"], key=lambda r: r["sockets"])
        doc["h100"] = {**old["h100"], **doc["h100"]}
    add_peers(doc)
    doc["seconds"] = round(time.time() - t0, 1)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.join(args.out_dir, "projections.png"))
    print(f"wrote {args.out_dir}/projections.json, .png ({doc['seconds']} s)")


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.6))
    for key, rows in _group(doc["paper_setting"]).items():
        a.plot([r["sockets"] for r in rows], [r["efficiency_sim"] for r in rows], "o-", label=f"{key} simulated")
        pub = [(r["sockets"], r["efficiency_published"]) for r in rows if r["efficiency_published"]]
        a.plot(*zip(*pub), "k*", ms=10)
    a.set(xlabel="CPU sockets", ylabel="scaling efficiency", title="(a) published setting (stars: published)")
    a.legend(fontsize=7)
    for name, w in doc["h100"].items():
        rows = [r for r in w["fastdecode"] if r["sockets"]]
        alone = next((r for r in w["fastdecode"] if not r["sockets"]), {"output_tokens_per_s": None})
        xs = [r["sockets"] for r in rows]
        line, = b.plot(xs, [r["output_tokens_per_s"] for r in rows], "o-", label=f"{name}")
        if alone["output_tokens_per_s"]:
            b.axhline(alone["output_tokens_per_s"], ls="-.", color=line.get_color(), lw=1)
            c.axhline(alone["tokens_per_dollar"], ls="-.", color=line.get_color(), lw=1)
        if w["gpu_only_ceiling"].get("fits"):
            b.axhline(w["gpu_only_ceiling"]["output_tokens_per_s"], ls="--", color=line.get_color(), lw=1)
        c.plot(xs, [r["tokens_per_dollar"] for r in rows], "o-", color=line.get_color(), label=name)
        if w["gpu_only_ceiling"].get("fits"):
            c.axhline(w["gpu_only_ceiling"]["tokens_per_dollar"], ls="--", color=line.get_color(), lw=1)
    b.axhline(TUNED_GPU_ONLY_8B, ls=":", color="k", lw=1, label="tuned GPU-only 8B (stated)")
    b.set(xscale="log", yscale="log", xlabel="CPU sockets", ylabel="output tokens/s",
          title="(b) one H100 + sockets (dash-dot: H100 alone; dashed: ceiling)")
    c.set(xscale="log", yscale="log", xlabel="CPU sockets", ylabel="output tokens per $",
          title=f"per dollar (GPU \\${GPU_HOUR:.2f}/h, socket \\${SOCKET_HOUR:.2f}/h)")
    for ax in (b, c):
        ax.set_xticks([p for p in SOCKETS if p], [str(p) for p in SOCKETS if p])
        ax.minorticks_off()
    b.legend(fontsize=7)
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _group(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(f"{r['model']} L={r['L']}", []).append(r)
    return out


if __name__ == "__main__":
    main()
