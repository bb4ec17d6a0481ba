"""Admission controllers in the simulator (fastdecode.admission.simulate): FIFO, the stabilized
schedule, and the stabilized schedule with W_lim at the bare mean projected peak (the rule before
the prompt-spread margin), over request sets that differ in how lengths vary.

Per case and controller: decode steps to finish, and over the saturated steps after the ramp
(queue not empty, step >= 2*S) the workload's coefficient of variation and the running count.

    PYTHONPATH=. python bench/admission_sim.py     # writes bench/results/admission_sim.{json,png}
"""
from __future__ import annotations

import json
import os

import numpy as np

from fastdecode.admission import FifoAdmission, StabilizedAdmission, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B = 64


def cases(seed: int) -> dict:
    """name -> (requests [(prompt, max_tokens)], steps each really runs or None)."""
    rng = np.random.default_rng(seed)
    return {
        "gen 512, prompts 16-64": ([(int(p), 512) for p in rng.integers(16, 65, 1500)], None),
        "gen 512, prompts log-normal (median 200)":
            ([(int(min(4000, p)), 512) for p in rng.lognormal(np.log(200), 1.0, 1500)], None),
        "gen log-normal (median 512), prompts 16-64":
            ([(int(p), int(g)) for p, g in zip(rng.integers(16, 65, 1500),
                                               np.clip(rng.lognormal(np.log(512), 0.6, 1500), 85, 2048))], None),
        "max_tokens 1024, EOS uniform 50-1024, prompts 16-64":
            ([(int(p), 1024) for p in rng.integers(16, 65, 1500)], rng.integers(50, 1025, 1500)),
    }


def measure(ctl, reqs, eos) -> dict:
    r = simulate(ctl, reqs, eos)
    S = int(np.max(np.array(reqs)[:, 1]))
    steady = (r.waiting > 0) & (np.arange(len(r.running)) >= 2 * S)
    w, run = r.workload[steady], r.running[steady]
    return {"steps": len(r.running), "steady_steps": int(steady.sum()),
            "workload_cv": round(float(w.std() / w.mean()), 4) if w.size else None,
            "running_mean": round(float(run.mean()), 2) if run.size else None,
            "running_min": int(run.min()) if run.size else None}


def main():
    rows = []
    for seed in (0, 1, 2):
        for name, (reqs, eos) in cases(seed).items():
            for ctl_name, ctl in (("fifo", FifoAdmission(B)), ("stabilized", StabilizedAdmission(B)),
                                  ("stabilized, W_lim at the mean peak",
                                   StabilizedAdmission(B, margin_sigmas=0))):
                row = {"case": name, "seed": seed, "controller": ctl_name, **measure(ctl, reqs, eos)}
                rows.append(row)
                print(row, flush=True)
    for row in rows:            # steps relative to FIFO on the same request set
        fifo = next(r for r in rows if r["case"] == row["case"] and r["seed"] == row["seed"]
                    and r["controller"] == "fifo")
        row["steps_over_fifo"] = round(row["steps"] / fifo["steps"], 4)
    path = os.path.join(ROOT, "bench", "results", "admission_sim")
    with open(path + ".json", "w") as f:
        json.dump({"target_batch": B, "rows": rows}, f, indent=1)
    plot(rows, path + ".png")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(dict.fromkeys(r["case"] for r in rows))
    ctls = list(dict.fromkeys(r["controller"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, c in enumerate(ctls):
        for i, n in enumerate(names):
            cv = [r["workload_cv"] for r in rows if r["case"] == n and r["controller"] == c]
            ax.scatter([i + (j - 1) * 0.2] * len(cv), cv, color=f"C{j}", label=c if i == 0 else None)
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
    ax.set_ylabel(f"workload CV, saturated steps (B = {B})")
    ax.set_title("admission in the simulator: 3 seeds per request set")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
