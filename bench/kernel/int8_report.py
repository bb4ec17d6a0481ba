"""What int8_bench.py makes of its measurements: each point's comparisons (int8 against bf16 and
fp32, VNNI against no-VNNI, the appends), the targets they are held to, the summary table printed
at the end of a run, and the plot. The summary and the plot read the result dict alone (the JSON
file int8_bench.py writes), so `int8_bench.py --replot JSON` redraws an earlier run.
"""
from __future__ import annotations

import numpy as np

# kernel_fixtures first: it puts this checkout (and tests/) on sys.path
from kernel_fixtures import MODELS

TARGETS = dict(int8_over_bf16=1.8, int8_pct_of_read=85.0, append_pct_of_attention=5.0)
# a colour per side of int8_bench.SIDES, in its order (the order of the bars)
COLORS = {"int8": "tab:purple", "int8_novnni": "plum", "bf16": "tab:blue", "fp32": "tab:red"}


def compare(rows: list[dict], secs: dict, app: dict, vnni_same, reads: list[float], rounds: int,
            **point) -> dict:
    """The point's comparison record (`point`: model, context, batch, fill_seconds): the reads,
    and int8 against bf16 and fp32, VNNI against no-VNNI, and the appends against each other."""
    by_side = {r["side"]: r for r in rows}
    cmp = dict(**point, reads_gbps=reads, read_median_gbps=float(np.median(reads)), read_best_gbps=float(max(reads)),
               rounds=rounds, extent_slack_pct={r["side"]: 100 * (r["bytes_used"] / r["bytes_committed"] - 1)
                                                for r in rows})

    def ratio(a, b):     # speed a / speed b, per round, and the rounds a won
        x = np.array(secs[b]) / np.array(secs[a])
        return float(np.median(x)), int(np.sum(x > 1))

    if "int8" in by_side and "bf16" in by_side:
        cmp["int8_over_bf16"], cmp["int8_wins_over_bf16"] = ratio("int8", "bf16")
        cmp["bytes_bf16_over_int8"] = by_side["bf16"]["bytes_used"] / by_side["int8"]["bytes_used"]
    if "int8" in by_side and "fp32" in by_side:
        cmp["int8_over_fp32"], _ = ratio("int8", "fp32")
    if "int8" in by_side and "int8_novnni" in by_side:
        cmp["vnni_over_novnni"], cmp["vnni_wins"] = ratio("int8", "int8_novnni")
        cmp["vnni_outputs_identical"], cmp["vnni_max_abs_diff"] = vnni_same
    if "int8" in app:
        cmp["int8_append_pct_of_int8_attention"] = by_side["int8"]["append_pct_of_own_attention"]
        for s in app:
            if s != "int8":
                cmp[f"int8_append_over_{s}_append"] = by_side["int8"]["append_seconds_median"] / \
                    by_side[s]["append_seconds_median"]
    return cmp


def targets(cmps: list[dict], res: list[dict]) -> dict:
    i8 = [r["pct_of_read"] for r in res if r["side"] == "int8"]
    sp = [c["int8_over_bf16"] for c in cmps if "int8_over_bf16" in c]
    ap = [c["int8_append_pct_of_int8_attention"] for c in cmps if "int8_append_pct_of_int8_attention" in c]
    return {
        "int8_over_bf16": dict(target=f">= {TARGETS['int8_over_bf16']}", worst=min(sp, default=float("nan")),
                               met=sum(x >= TARGETS["int8_over_bf16"] for x in sp), of=len(sp)),
        "int8_pct_of_read": dict(target=f">= {TARGETS['int8_pct_of_read']}", worst=min(i8, default=float("nan")),
                                 met=sum(x >= TARGETS["int8_pct_of_read"] for x in i8), of=len(i8)),
        "append_pct_of_attention": dict(target=f"<= {TARGETS['append_pct_of_attention']}",
                                        worst=max(ap, default=float("nan")),
                                        met=sum(x <= TARGETS["append_pct_of_attention"] for x in ap), of=len(ap)),
    }


def print_summary(d: dict) -> None:
    res, cmps = d["results"], d["comparisons"]
    print(f"\n{d['label']}: {d['threads']} threads, {d['rounds']} rounds, medians; %read: of the median read "
          f"measured before, during and after each point; "
          f"GB/s of bytes_committed")
    print(f"{'model':13s} {'ctx':>6s} {'B':>5s} {'read':>5s} | {'M tok/s int8':>12s} {'novnni':>7s} {'bf16':>6s} "
          f"{'fp32':>6s} | {'%read int8':>10s} {'bf16':>5s} {'fp32':>5s} | {'int8/bf16':>9s} {'vnni':>5s} | "
          f"{'append us int8':>14s} {'bf16':>6s} {'fp32':>6s} {'%attn':>6s}")
    for c in cmps:
        by = {r["side"]: r for r in res if r["model"] == c["model"] and r["context"] == c["context"]}

        def f(s, key, scale=1.0, fmt="6.2f", by=by):
            return format(by[s][key] * scale, fmt) if s in by and key in by[s] else "-"

        def g(key, fmt, c=c):
            return format(c[key], fmt) if key in c else "-"
        print(f"{c['model']:13s} {c['context']:6d} {c['batch']:5d} {c['read_median_gbps']:5.1f} | "
              f"{f('int8', 'tokens_per_s', 1e-6, '12.2f'):>12s} {f('int8_novnni', 'tokens_per_s', 1e-6, '7.2f'):>7s} "
              f"{f('bf16', 'tokens_per_s', 1e-6):>6s} {f('fp32', 'tokens_per_s', 1e-6):>6s} | "
              f"{f('int8', 'pct_of_read', 1, '9.0f'):>9s}% {f('bf16', 'pct_of_read', 1, '4.0f'):>4s}% "
              f"{f('fp32', 'pct_of_read', 1, '4.0f'):>4s}% | {g('int8_over_bf16', '8.2f'):>8s}x "
              f"{g('vnni_over_novnni', '4.2f'):>4s}x | {f('int8', 'append_seconds_median', 1e6, '14.0f'):>14s} "
              f"{f('bf16', 'append_seconds_median', 1e6, '6.0f'):>6s} "
              f"{f('fp32', 'append_seconds_median', 1e6, '6.0f'):>6s} "
              f"{g('int8_append_pct_of_int8_attention', '5.2f'):>5s}%")
    for p in d["prefill"]:
        if p["kv_dtype"] == "int8":
            print(f"prefill {p['model']:13s} {p['sequences']:4d} x {p['prompt_tokens']} tokens from {p['in_dtype']}: "
                  f"int8 {p['input_gbps']:5.2f} GB/s of input = {p['int8_over_bf16_input_gbps']:.2f}x bf16's "
                  f"(copy {p['copy_gbps_same_input']:.1f})")
    t = d["targets"]
    print("targets: " + ", ".join(f"{k} {v['target']} -> worst {v['worst']:.2f} ({v['met']}/{v['of']} met)"
                                  for k, v in t.items() if v["of"]))


def plot(d: dict, path_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, cmps = d["results"], d["comparisons"]
    models = [m for m in MODELS if any(r["model"] == m for r in res)]
    sides = [s for s in COLORS if any(r["side"] == s for r in res)]
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 7.6), squeeze=False)
    w = 0.8 / len(sides)
    for j, m in enumerate(models):
        ctxs = sorted({r["context"] for r in res if r["model"] == m})
        x = np.arange(len(ctxs))
        top, bot = axes[0][j], axes[1][j]
        for i, s in enumerate(sides):
            rs = [next((r for r in res if r["model"] == m and r["context"] == c and r["side"] == s), None)
                  for c in ctxs]
            xs = x + (i - (len(sides) - 1) / 2) * w
            tps = [r["tokens_per_s"] / 1e6 if r else 0 for r in rs]
            top.bar(xs, tps, w, color=COLORS[s], label=s)
            # the bandwidth line: tokens/s if this side's bytes streamed at the adjacent read rate
            bound = [r["read_median_gbps"] * 1e3 * r["batch"] * r["context"] / r["bytes_committed"] if r else 0
                     for r in rs]
            top.hlines(bound, xs - w / 2, xs + w / 2, color="black", lw=1.2,
                       label="read bandwidth (median of the point's reads)" if i == 0 else None)
            bot.bar(xs, [r["pct_of_read"] if r else 0 for r in rs], w, color=COLORS[s], label=s)
        ticks = []
        for c in ctxs:
            cm = next((c2 for c2 in cmps if c2["model"] == m and c2["context"] == c), {})
            ticks.append(f"{c}" + (f"\nint8/bf16 {cm['int8_over_bf16']:.2f}x" if "int8_over_bf16" in cm else "")
                         + (f"\nVNNI/not {cm['vnni_over_novnni']:.2f}x" if "vnni_over_novnni" in cm else ""))
        top.set_xticks(x, ticks, fontsize=8)
        bot.set_xticks(x, [str(c) for c in ctxs])
        top.set_title(m)
        top.set_ylabel("M tokens/s (sequences x context / s)")
        bot.set_ylabel("% of read bandwidth (median)")
        bot.set_xlabel("context (tokens)")
        bot.axhline(TARGETS["int8_pct_of_read"], color="gray", ls="--", lw=0.8)
        bot.axhline(100, color="gray", lw=0.8)
        for ax in (top, bot):
            ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.suptitle(f"{d['label']}: {d['cpu']}, {d['threads']} threads, one run, medians of {d['rounds']} interleaved "
                 f"rounds; black: the tokens/s of the read bandwidth at each side's bytes per token; "
                 f"dashed: int8's {TARGETS['int8_pct_of_read']:.0f}% target", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path_png, dpi=110)
