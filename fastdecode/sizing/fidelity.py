"""How far `plan`'s predictions have been from measured runs, for `plan` to say next to its own.

The numbers come from the committed fidelity results (bench/sizing/results/*fidelity_*.json:
a profile, plans from it, and the runs measured) through `derive`; bench/sizing/fidelity_table.py
writes them into fidelity_table.py, and a test checks that the two agree. Errors are the
prediction's relative to the measurement ((predicted - measured) / measured), grouped by the kind
of S-worker (cpu, gpu) and the side the plan said bounds (S, R, link, capacity).
"""
from __future__ import annotations

import glob
import json
import os
from collections import defaultdict


def s_worker_kind(device: str) -> str:
    return "cpu" if device.startswith("cpu") else "gpu"


def derive(results_dir: str) -> dict[tuple[str, str], dict]:
    """(S-worker kind, bound) -> {runs, step_latency_error: [lo, hi], tokens_per_s_error: [lo, hi],
    results: [file stems]}, over every plan-fidelity run in results_dir; (kind, "any") too."""
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(results_dir, "*fidelity_*.json"))):
        stem = os.path.basename(path).removesuffix(".json")
        if stem.startswith("sim_"):                      # the simulator's fidelity, not plan's
            continue
        with open(path) as f:
            doc = json.load(f)
        kinds = {name: s_worker_kind(p["s_worker"]["device"]) for name, p in doc.get("profiles", {}).items()}
        for run in doc.get("runs", []):
            kind = kinds.get(run.get("profile")) or (next(iter(set(kinds.values()))) if len(set(kinds.values())) == 1
                                                     else None)
            if kind is None or "step_latency_error" not in run:
                continue
            for bound in (run["predicted_bound"], "any"):
                groups[(kind, bound)].append((run["step_latency_error"], run["tokens_per_s_error"], stem))
    return {key: {"runs": len(rows),
                  "step_latency_error": [round(min(r[0] for r in rows), 3), round(max(r[0] for r in rows), 3)],
                  "tokens_per_s_error": [round(min(r[1] for r in rows), 3), round(max(r[1] for r in rows), 3)],
                  "results": sorted({r[2] for r in rows})}
            for key, rows in sorted(groups.items())}


def fidelity(device: str, bound: str, measured_profile: bool) -> dict | None:
    """What the committed runs say of a plan on this S-worker `device` bound by `bound`: that
    bound's row, else the S-worker kind's over every bound; None if there is none."""
    from fastdecode.sizing.fidelity_table import FIDELITY
    kind = s_worker_kind(device)
    for key in ((kind, bound), (kind, "any")):
        if key in FIDELITY:
            return {"s_worker": kind, "bound": key[1], "measured_profile": measured_profile, **FIDELITY[key]}
    return None


def _pct(span: list[float]) -> str:
    lo, hi = (f"{100 * x:+.0f}%" for x in span)
    return lo if lo == hi else f"{lo} to {hi}"


def fidelity_line(fid: dict | None, bound: str) -> str:
    """One line for plan's output."""
    if fid is None:
        return "fidelity: no measured run to compare with (bench/sizing/results)"
    what = f"plans bound by {bound}" if fid["bound"] == bound else \
        f"plans of any bound (none bound by {bound} measured)"
    runs = f"{fid['runs']} run{'s' if fid['runs'] != 1 else ''}"
    caveat = "" if fid["measured_profile"] else \
        "; those planned from measured profiles, stated hardware adds its own error"
    return (f"fidelity: {what} on a {fid['s_worker'].upper()} S-worker have been off by "
            f"{_pct(fid['step_latency_error'])} in step latency and {_pct(fid['tokens_per_s_error'])} in tokens/s "
            f"(predicted against measured, {runs} in bench/sizing/results{caveat})")
