"""A run's per-step statistics (--stats-json) as one figure, `fastdecode report ... -o run.png`.

Five panels over the run's time: running sequences; KV tokens per R-worker; the S-part's and the
slowest R-worker's time per decode step; each side's idle (bubble) fraction of the step; tokens
per second. matplotlib is optional (`pip install 'fastdecode[plot]'`): imported only here, and
without pyplot, so no display or backend is needed.
"""
from __future__ import annotations

import numpy as np

PANELS = ("running sequences", "KV tokens per R-worker", "S vs R time per decode step",
          "idle (bubble) fraction of a decode step", "throughput")


def step_times(stats: dict) -> np.ndarray:
    """[steps] seconds since the run's first step began, at each row's end. Files written before
    rows carried t_s: the steps' own durations summed, scaled by the sampling stride."""
    rows = stats["steps"]
    if all("t_s" in r for r in rows):
        return np.array([r["t_s"] for r in rows], dtype=np.float64)
    return np.cumsum([r["step_s"] for r in rows]) * stats.get("steps_stride", 1)


def series(stats: dict) -> dict[str, np.ndarray]:
    """The figure's data from a --stats-json document; decode-only series are over decode rows."""
    rows = stats["steps"]
    workers = max((len(r["kv_tokens"]) for r in rows), default=0)
    t = step_times(stats)
    dec = [i for i, r in enumerate(rows) if "s_time_s" in r]
    decode_s = np.array([rows[i]["step_s"] - rows[i]["prefill_s"] for i in dec], dtype=np.float64)
    s_time = np.array([rows[i]["s_time_s"] for i in dec], dtype=np.float64)
    r_time = np.array([rows[i].get("r_time_max_s", np.nan) for i in dec], dtype=np.float64)
    span = np.where(decode_s > 0, decode_s, np.nan)
    made = np.array([r.get("tokens", r["active"]) for r in rows], dtype=np.float64)
    return {"t": t, "active": np.array([r["active"] for r in rows], dtype=np.float64),
            "kv_tokens": np.array([[r["kv_tokens"][w] for r in rows] for w in range(workers)],
                                  dtype=np.float64).reshape(workers, len(rows)),       # [workers, steps]
            "t_decode": t[dec], "s_time_s": s_time, "r_time_s": r_time,
            "s_idle": 1 - s_time / span, "r_idle": 1 - r_time / span,
            "tokens_per_s": made / np.array([max(r["step_s"], 1e-9) for r in rows], dtype=np.float64)}


def figure(stats: dict):
    """A matplotlib Figure of the run: len(PANELS) axes, one per panel, top to bottom."""
    from matplotlib.figure import Figure

    d = series(stats)
    fig = Figure(figsize=(10, 2.3 * len(PANELS)), layout="constrained")
    ax = fig.subplots(len(PANELS), 1, sharex=True)
    ax[0].plot(d["t"], d["active"], color="tab:blue")
    for w, kv in enumerate(d["kv_tokens"]):
        ax[1].plot(d["t"], kv, label=f"R-worker {w + 1}")
    ax[2].plot(d["t_decode"], d["s_time_s"], label="S-part (busy)", color="tab:orange")
    ax[2].plot(d["t_decode"], d["r_time_s"], label="slowest R-worker (attention)", color="tab:green")
    ax[3].plot(d["t_decode"], d["s_idle"], label="S idle", color="tab:orange")
    ax[3].plot(d["t_decode"], d["r_idle"], label="R idle", color="tab:green")
    ax[4].plot(d["t"], d["tokens_per_s"], color="tab:purple", linewidth=0.8)
    labels = ("sequences", "tokens", "seconds", "fraction", "tokens/s")
    for a, title, label in zip(ax, PANELS, labels):
        a.set_title(title, fontsize=10, loc="left")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
        if len(a.lines) > 1:
            a.legend(fontsize=8, loc="upper right")
    ax[3].set_ylim(0, 1)
    ax[-1].set_xlabel("seconds since the first step")
    summary = stats.get("summary") or {}
    if summary.get("output_tokens_per_s") is not None:
        fig.suptitle(f"{summary.get('output_tokens', 0)} tokens in {summary.get('wall_s', 0):.1f} s: "
                     f"{summary['output_tokens_per_s']:.1f} output tokens/s"
                     + (f", bound by {summary['bound']}" if summary.get("bound") else ""))
    return fig
