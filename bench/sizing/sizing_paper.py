"""The FastDecode paper's strong-scaling setting from stated hardware, through the sizing model.

One A10-class GPU, Llama-7B/13B, 1..8 AMD EPYC sockets, context 1024 and 128.
Paper: scaling 1 -> 8 sockets keeps 72.8% (7B, L=1024), 84.1% (13B, L=1024), 37.6% (13B, L=128,
where 4 sockets keep 75.9% and 8 are slower than 4).

Efficiency(P) = tokens/s with P sockets / (P x tokens/s with 1 socket).
Three passes: (1) a priori, datasheet numbers only; (2) one parameter, the attention bandwidth
per socket, fitted to the 13B/L=128 4-socket point; (3) that bandwidth plus a fixed cost per
attention call fitted to the 7B/L=1024 point, leaving 13B/L=1024 as the held-out check.

    python3 bench/sizing/sizing_paper.py   # writes bench/sizing/results/sizing_paper.{json,png}
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed

from fastdecode.sizing.hardware import GPU_PRESETS, stated_profile  # noqa: E402
from fastdecode.sizing.model import predict  # noqa: E402
from fastdecode.sizing.schema import MODEL_PRESETS  # noqa: E402

# ---- stated hardware (assumptions, not measurements)
GPU = GPU_PRESETS["a10"]          # datasheet: 125 dense bf16 TFLOP/s, 600 GB/s GDDR6, 24 GB
EPYC_READ_GBPS = 150.0            # one socket, 8 x DDR4-3200 = 204.8 GB/s peak; ~75% read (STREAM-like)
ATTN_EFF = 0.66                   # attention / read bandwidth: torch SDPA bf16 on the H100 box (docs/design.md)
EPYC_MEM_GB = 256.0               # per socket (dual-socket nodes with 512 GB)
LINK_GBPS, LINK_US = 12.5, 10.0   # InfiniBand 100 Gb/s, MPI + GPU copy latency
CALL_US = 20.0                    # per attention call (one layer, one mini-batch)
DEPTH = 2                         # the paper's 2-stage pipeline
# the paper's R-workers keep the KV a sequence has filled (no worst-case reservation), token by
# token: fastdecode's --kv-reserve grow without page rounding
PAPER_KV_RESERVE, PAPER_PAGE_TOKENS = "grow", 1
SOCKETS = [1, 2, 4, 8]
BATCHES = [256, 512, 1024]
MAIN_BATCH = 512                  # the largest power of two whose KV fits one socket for both models at L=1024
PAPER = {("llama-7b", 1024): {8: 0.728}, ("llama-13b", 1024): {8: 0.841},
         ("llama-13b", 128): {4: 0.759, 8: 0.376}}
# how "context L" maps to the average KV length of a running sequence
# (generation length, prompt length). Stabilized, a sequence's average KV is prompt + gen/2.
READINGS = {"gen=L": lambda L: (L, 0),                # average KV L/2, no prefill
            "prompt=L/2,gen=L": lambda L: (L, L // 2)}  # average KV L, prefill B/2 tokens per step


def scaling(model: str, L: int, batch: int, reading: str, attn_GBps: float, call_us: float) -> dict:
    gen, prompt = READINGS[reading](L)
    prof = stated_profile(GPU, MODEL_PRESETS[model], attn_GBps, EPYC_MEM_GB, LINK_GBPS, LINK_US,
                          cpu_attn_eff=1.0, call_overhead_us=call_us)
    for w in prof.r_workers:
        w.page_tokens = PAPER_PAGE_TOKENS
    preds = {p: predict(prof, batch, gen, prompt, rworkers=p, depth=DEPTH, kv_reserve=PAPER_KV_RESERVE)
             for p in SOCKETS}
    base = preds[1].tokens_per_s
    return {"model": model, "L": L, "batch": batch, "reading": reading,
            "tokens_per_s": {p: round(x.tokens_per_s, 1) for p, x in preds.items()},
            "efficiency": {p: round(x.tokens_per_s / (p * base), 4) for p, x in preds.items()},
            "bound": {p: x.bound for p, x in preds.items()},
            "batch_run": {p: x.batch_run for p, x in preds.items()},
            "rworkers_needed": preds[1].rworkers_needed}


def bisect(f, lo: float, hi: float, target: float, iters: int = 60) -> float:
    """x in [lo, hi] with f(x) = target, for f decreasing in x."""
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo * hi) ** 0.5


def all_cases(attn_GBps: float, call_us: float, reading: str, batch: int) -> list[dict]:
    return [scaling(m, L, batch, reading, attn_GBps, call_us) for (m, L) in PAPER]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args(argv)
    a_priori_GBps = EPYC_READ_GBPS * ATTN_EFF
    out = {"hardware": {"gpu": {"name": GPU.name, "peak_tflops": GPU.peak_tflops, "mem_bw_GBps": GPU.mem_bw_GBps,
                                "mem_GB": GPU.mem_GB, "compute_eff": GPU.compute_eff, "memory_eff": GPU.memory_eff},
                        "epyc_read_GBps_per_socket": EPYC_READ_GBPS, "attention_eff": ATTN_EFF,
                        "epyc_mem_GB_per_socket": EPYC_MEM_GB, "link_GBps": LINK_GBPS, "link_latency_us": LINK_US,
                        "call_overhead_us": CALL_US, "pipeline_depth": DEPTH},
           "paper": {f"{m} L={L}": v for (m, L), v in PAPER.items()},
           "a_priori": [], "fit_bandwidth": {}, "fit_bandwidth_and_overhead": {}}
    for reading in READINGS:
        for batch in BATCHES:
            out["a_priori"] += all_cases(a_priori_GBps, CALL_US, reading, batch)
        # (2) fit the attention bandwidth per socket to 13B, L=128, 4 sockets = 75.9%
        eff4 = lambda bw: scaling("llama-13b", 128, MAIN_BATCH, reading, bw, CALL_US)["efficiency"][4]
        bw = bisect(eff4, 1.0, 2000.0, PAPER[("llama-13b", 128)][4])
        out["fit_bandwidth"][reading] = {"attn_GBps_per_socket": round(bw, 2),
                                         "cases": all_cases(bw, CALL_US, reading, MAIN_BATCH)}
        # (3) keep that bandwidth, fit a fixed cost per attention call to 7B, L=1024, 8 sockets = 72.8%
        eff8 = lambda c: scaling("llama-7b", 1024, MAIN_BATCH, reading, bw, c)["efficiency"][8]
        call = bisect(eff8, 1e-2, 1e6, PAPER[("llama-7b", 1024)][8])
        out["fit_bandwidth_and_overhead"][reading] = {
            "attn_GBps_per_socket": round(bw, 2), "call_overhead_us": round(call, 1),
            "cases": all_cases(bw, call, reading, MAIN_BATCH)}
    out["summary"] = summary(out)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "sizing_paper.json"), "w") as f:
        json.dump(out, f, indent=1)
    report(out)
    plot(out, os.path.join(args.out_dir, "sizing_paper.png"))


def summary(out: dict) -> list[dict]:
    """One row per paper point: the paper's efficiency and each pass's prediction."""
    rows = []
    for (m, L), points in PAPER.items():
        for p, paper in points.items():
            row = {"model": m, "L": L, "sockets": p, "paper": paper}
            for reading in READINGS:
                pick = lambda cases, B=MAIN_BATCH: next(c for c in cases if (c["model"], c["L"], c["batch"]) == (m, L, B))
                apriori = [c for c in out["a_priori"] if c["reading"] == reading]
                row[f"a_priori[{reading}]"] = {B: pick(apriori, B)["efficiency"][p] for B in BATCHES}
                row[f"fit_bandwidth[{reading}]"] = pick(out["fit_bandwidth"][reading]["cases"])["efficiency"][p]
                row[f"fit_bandwidth_and_overhead[{reading}]"] = pick(
                    out["fit_bandwidth_and_overhead"][reading]["cases"])["efficiency"][p]
            rows.append(row)
    return rows


def report(out: dict) -> None:
    def line(tag, c):
        e = c["efficiency"]
        paper = PAPER[(c["model"], c["L"])]
        print(f"  {tag:<34} {c['model']:<10} L={c['L']:<5} B={c['batch']:<5} eff4 {e[4]:6.1%} eff8 {e[8]:6.1%}"
              f"  paper {', '.join(f'{k}:{v:.1%}' for k, v in paper.items())}  bound@1,8 {c['bound'][1]},{c['bound'][8]}")
    for reading in READINGS:
        print(f"== {reading}")
        for c in out["a_priori"]:
            if c["reading"] == reading and c["batch"] == MAIN_BATCH:
                line("a priori", c)
        fb = out["fit_bandwidth"][reading]
        for c in fb["cases"]:
            line(f"fit bw {fb['attn_GBps_per_socket']} GB/s", c)
        fo = out["fit_bandwidth_and_overhead"][reading]
        for c in fo["cases"]:
            line(f"fit bw {fo['attn_GBps_per_socket']}, call {fo['call_overhead_us']} us", c)


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    reading = "gen=L"
    sets = [("a priori", [c for c in out["a_priori"] if c["reading"] == reading and c["batch"] == MAIN_BATCH], "-"),
            ("fit: bandwidth", out["fit_bandwidth"][reading]["cases"], "--"),
            ("fit: bandwidth + call cost", out["fit_bandwidth_and_overhead"][reading]["cases"], ":"),
            ("a priori, prompt L/2 + gen L", [c for c in out["a_priori"]
                                              if c["reading"] == "prompt=L/2,gen=L" and c["batch"] == MAIN_BATCH], "-.")]
    for ax, key in zip(axes, PAPER):
        for label, cases, style in sets:
            c = next(c for c in cases if (c["model"], c["L"]) == key)
            ax.plot(SOCKETS, [c["efficiency"][p] for p in SOCKETS], style, marker="o", label=label)
        ax.plot(list(PAPER[key]), list(PAPER[key].values()), "k*", markersize=12, label="paper")
        ax.set_title(f"{key[0]}, L={key[1]}, B={MAIN_BATCH}")
        ax.set_xlabel("CPU sockets")
        ax.set_xticks(SOCKETS)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("strong-scaling efficiency vs 1 socket")
    axes[0].legend(fontsize=8)
    fig.suptitle("Sizing model vs the FastDecode paper's scaling (A10 + EPYC sockets; L = generation length, no prompt, unless noted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
