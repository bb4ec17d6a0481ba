"""A simulated run as numbers: the summary (the engine's own keys where it has them,
fastdecode/engine/stats.py), a timeline of each side's utilisation and bubbles, and per-step rows
shaped like `generate --stats-json` so `fastdecode report`'s figure draws them."""
from __future__ import annotations

import numpy as np

from fastdecode.sim.core import SimRun, weighted_percentile
from fastdecode.sim.trace import Trace

MAX_ROWS = 65_536          # per-step rows in the JSON (evenly spaced when the run has more)
TIMELINE_BINS = 100


def _r(x: float, nd: int = 6):
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


def summary(run: SimRun, trace: Trace) -> dict:
    st = run.steps
    t_end = st["t_s"]
    wall = float(t_end[-1]) if t_end.size else 0.0
    out_tokens = int(st["tokens"].sum())
    decode_s = float(st["decode_s"].sum())
    s_busy = float(st["s_time_s"].sum())
    r_busy = st["r_busy_s"].sum(axis=0)                               # [P]
    r_max = float(st["r_busy_s"].max(axis=1, initial=0.0).sum()) if t_end.size else 0.0
    prefill = float(st["prefill_s"].sum())
    span = st["span"]                                                 # [T] steps each record stands for
    tier_kv = float((st["tier_kv_tokens"] * span).sum())
    kv_all = float((st["kv_tokens"].sum(axis=1) * span).sum()) + tier_kv
    decoding = st["active"] > 0
    done = run.finish_s >= 0
    return {
        "wall_s": _r(wall, 4), "steps": int(span.sum()), "decode_steps": int(span[decoding].sum()),
        "requests": len(trace), "requests_finished": int(done.sum()),
        "output_tokens": out_tokens, "prompt_tokens": int(trace.prompt_len[done].sum()),
        "output_tokens_per_s": _r(out_tokens / wall, 3) if wall else None,
        "token_latency_p50_s": _r(weighted_percentile(run.gap_s, run.gap_count, 50)),
        "token_latency_p99_s": _r(weighted_percentile(run.gap_s, run.gap_count, 99)),
        "decode_s": _r(decode_s, 4), "prefill_s": _r(prefill, 4),
        # the engine's bubble fractions: each side's idle share of the decode time
        "s_bubble_fraction": _r(1 - s_busy / decode_s, 4) if decode_s else None,
        "r_bubble_fraction": _r(1 - r_max / decode_s, 4) if decode_s else None,
        "bound": ("S" if s_busy >= r_max else "R") if decode_s else None,
        # busy share of the whole wall time (prefill is the S-worker's)
        "utilisation": {"s_worker": _r((s_busy + prefill) / wall, 4) if wall else None,
                        "r_workers": [_r(b / wall, 4) for b in r_busy] if wall else [],
                        # the S-worker's own tier's attention (inside s_worker's share)
                        "device_tier": _r(float(st["tier_busy_s"].sum()) / wall, 4) if wall else None,
                        "link_out": _r(float(st["link_out_s"].sum()) / wall, 4) if wall else None,
                        "link_back": _r(float(st["link_back_s"].sum()) / wall, 4) if wall else None},
        "running_mean": _r(float(np.average(st["active"][decoding], weights=span[decoding])), 2)
        if decode_s else None,
        "running_max": int(st["active"].max(initial=0)),
        # where the KV lived: the S-worker's own tier's share of the KV tokens held, over the decode steps
        "tier_kv_share": _r(tier_kv / kv_all, 4) if kv_all else None,
    }


def timeline(run: SimRun, bins: int = TIMELINE_BINS) -> list[dict]:
    """Each side's busy share and bubbles per slice of the run's time (steps binned by their end)."""
    st = run.steps
    if not st["t_s"].size:
        return []
    step_s = np.diff(st["t_s"], prepend=0.0)          # idle waits for arrivals count to the next step
    edges = np.linspace(0.0, float(st["t_s"][-1]), bins + 1)
    which = np.clip(np.searchsorted(edges, st["t_s"], side="left") - 1, 0, bins - 1)

    def per_bin(x):
        return np.bincount(which, weights=x, minlength=bins)

    span, s_busy = per_bin(step_s), per_bin(st["s_time_s"] + st["prefill_s"])
    r_max = per_bin(st["r_busy_s"].max(axis=1, initial=0.0))
    tokens, rows = per_bin(st["tokens"].astype(np.float64)), per_bin((st["active"] * st["span"]).astype(np.float64))
    count = np.bincount(which, weights=st["span"], minlength=bins)
    out = []
    for b in np.flatnonzero(count):
        out.append({"t_s": _r(edges[b + 1], 4), "running_mean": _r(rows[b] / count[b], 2),
                    "tokens_per_s": _r(tokens[b] / span[b], 3), "s_busy": _r(s_busy[b] / span[b], 4),
                    "r_busy_max": _r(r_max[b] / span[b], 4), "s_bubble": _r(1 - s_busy[b] / span[b], 4),
                    "r_bubble": _r(1 - r_max[b] / span[b], 4)})
    return out


def step_rows(run: SimRun, max_rows: int = MAX_ROWS) -> tuple[list[dict], int]:
    """The steps as `--stats-json` rows (fastdecode/engine/stats.py StepRecorder), every
    stride-th of them: -> (rows, stride). A span (SimConfig.span_steps) is one row, its last
    step's number and end, its times and tokens a step's mean."""
    st = run.steps
    n = st["t_s"].size
    stride = max(1, -(-n // max_rows))
    last_step = np.cumsum(st["span"])
    rows = []
    for i in range(0, n, stride):
        prefill, per = float(st["prefill_s"][i]), 1.0 / st["span"][i]
        row = {"step": int(last_step[i]), "t_s": _r(st["t_s"][i]), "active": int(st["active"][i]),
               "tokens": int(round(st["tokens"][i] * per)), "kv_tokens": [int(x) for x in st["kv_tokens"][i]],
               "prefill_s": _r(prefill), "step_s": _r(prefill + st["decode_s"][i] * per)}
        if st["span"][i] > 1:
            row["span"] = int(st["span"][i])
        if st["active"][i]:
            row["s_time_s"] = _r(st["s_time_s"][i] * per)
            row["r_time_max_s"] = _r(float(st["r_busy_s"][i].max(initial=0.0)) * per)
            row["r_busy_s"] = [_r(x * per) for x in st["r_busy_s"][i]]
            if st["tier_kv_tokens"][i] or st["tier_busy_s"][i]:
                row["tier_attend_s"] = _r(st["tier_busy_s"][i] * per)
        if st["tier_kv_tokens"][i]:
            row["tier_kv_tokens"] = int(st["tier_kv_tokens"][i])
        rows.append(row)
    return rows, stride


def document(run: SimRun, trace: Trace, setting: dict) -> dict:
    """The JSON `fastdecode simulate` writes."""
    rows, stride = step_rows(run)
    return {"summary": summary(run, trace), "setting": setting, "trace": trace.describe(),
            "admission": {k: v for k, v in run.admission.items() if k != "length_model"},
            "timeline": timeline(run), "steps_stride": stride, "steps": rows}
