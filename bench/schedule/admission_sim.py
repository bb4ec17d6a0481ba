"""Admission controllers in the simulator (fastdecode.sched.simulate): FIFO, the stabilized
schedule (lengths learnt from finished sequences), the same without W_lim's micro-batch of
slack for ages that slip when S/F is not whole (the rule before it), the stabilized schedule
that projects every sequence to its max_tokens bound (the rule before learnt lengths), and that
rule with W_lim at the bare mean projected peak and no slack (the rule before the prompt-spread
margin), over request sets that differ in how lengths vary.

Per case and controller: decode steps to finish; over the saturated steps after the ramp
(queue not empty, step >= 2*S) the workload's coefficient of variation and the running count;
and the time of a balanced S/R pipeline relative to FIFO's: the sum over steps of max(S, R),
with R = workload / (FIFO's mean saturated workload), so that S and R are equal at FIFO's mean
load (the setting where stabilizing pays, docs/design.md "Admission"), and either
- S = 1 per step ("S fixed"): a GPU below its batch knee, where a step costs the same however
  many sequences run, so an empty slot is lost throughput; or
- S = running / B ("S linear"): a compute-bound S-part, where an empty slot costs nothing.

    python3 bench/schedule/admission_sim.py     # writes bench/schedule/results/admission_sim.{json,png}
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)          # this checkout's packages, whatever else is installed

from fastdecode.sched.admission import FifoAdmission, StabilizedAdmission  # noqa: E402
from fastdecode.sched.simulate import simulate  # noqa: E402

B = 64


def cases(seed: int) -> dict:
    """name -> (requests [(prompt, max_tokens)], steps each really runs or None)."""
    rng = np.random.default_rng(seed)
    return {
        "gen 512, prompts 16-64": ([(int(p), 512) for p in rng.integers(16, 65, 1500)], None),
        "gen 1000, prompts 16-64": ([(int(p), 1000) for p in rng.integers(16, 65, 1500)], None),
        "gen 512, prompts log-normal (median 200)":
            ([(int(min(4000, p)), 512) for p in rng.lognormal(np.log(200), 1.0, 1500)], None),
        "gen log-normal (median 512), prompts 16-64":
            ([(int(p), int(g)) for p, g in zip(rng.integers(16, 65, 1500),
                                               np.clip(rng.lognormal(np.log(512), 0.6, 1500), 85, 2048))], None),
        "max_tokens 1024, EOS uniform 50-1024, prompts 16-64":
            ([(int(p), 1024) for p in rng.integers(16, 65, 1500)], rng.integers(50, 1025, 1500)),
    }


def measure(ctl, reqs, eos, w_fifo: float | None) -> dict:
    """w_fifo: FIFO's mean saturated workload on this request set (None: this is FIFO)."""
    r = simulate(ctl, reqs, eos)
    S = int(np.max(np.array(reqs)[:, 1]))
    steady = (r.waiting > 0) & (np.arange(len(r.running)) >= 2 * S)
    w, run = r.workload[steady], r.running[steady]
    w_ref = w_fifo or float(w.mean())
    return {"steps": len(r.running), "steady_steps": int(steady.sum()),
            "workload_cv": round(float(w.std() / w.mean()), 4) if w.size else None,
            "workload_mean": round(float(w.mean()), 1) if w.size else None,
            "running_mean": round(float(run.mean()), 2) if run.size else None,
            "running_min": int(run.min()) if run.size else None,
            "pipeline_time_s_fixed": float(np.maximum(1.0, r.workload / w_ref).sum()),
            "pipeline_time_s_linear": float(np.maximum(r.running / B, r.workload / w_ref).sum())}


def time_admit(batches=(1024, 4096, 16384), reps: int = 5) -> list[dict]:
    """Wall time of one admit() call with B - 100 sequences running (ages uniform in 0-1023,
    max_tokens 1024), 8,192 queued and 100 free slots, so the projection runs every call; the
    learnt model has 4,096 EOS stops and is refitted every call (the running ages change every
    step in the engine)."""
    import time
    rng = np.random.default_rng(0)
    out = []
    for b in batches:
        age0 = rng.integers(0, 1000, b - 100)
        prompt = rng.integers(16, 65, age0.size)
        steps = [list(zip((prompt + a).tolist(), (1024 - a).tolist(), a.tolist()))
                 for a in (age0 + i for i in range(reps + 1))]        # one step older each call
        waiting = [(int(p), 1024) for p in rng.integers(16, 65, 8192)]
        row = {"running": age0.size}
        for name, learn in (("learnt_ms", True), ("bound_ms", False)):
            ctl = StabilizedAdmission(b, ramp=False, w_lim=1e12, learn_lengths=learn)
            for x in rng.integers(50, 1025, 4096):
                ctl.observe_finished(int(x), True)
            ctl.admit(0, waiting, steps[0])
            t0 = time.perf_counter()
            for i in range(reps):
                ctl.admit(1 + i, waiting, steps[1 + i])
            row[name] = round((time.perf_counter() - t0) / reps * 1e3, 2)
        out.append(row)
        print(row, flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args(argv)
    rows = []
    for seed in (0, 1, 2):
        for name, (reqs, eos) in cases(seed).items():
            w_fifo = None
            for ctl_name, ctl in (("fifo", FifoAdmission(B)), ("stabilized", StabilizedAdmission(B)),
                                  ("stabilized, no slip slack", StabilizedAdmission(B, slip_slack=False)),
                                  ("stabilized, bound projection", StabilizedAdmission(B, learn_lengths=False)),
                                  ("stabilized, bound projection, W_lim at the mean peak",
                                   StabilizedAdmission(B, margin_sigmas=0, learn_lengths=False, slip_slack=False))):
                row = {"case": name, "seed": seed, "controller": ctl_name, **measure(ctl, reqs, eos, w_fifo)}
                w_fifo = w_fifo or row["workload_mean"]
                rows.append(row)
                print(row, flush=True)
    for row in rows:            # steps and pipeline time relative to FIFO on the same request set
        fifo = next(r for r in rows if r["case"] == row["case"] and r["seed"] == row["seed"]
                    and r["controller"] == "fifo")
        row["steps_over_fifo"] = round(row["steps"] / fifo["steps"], 4)
        for key in ("pipeline_time_s_fixed", "pipeline_time_s_linear"):
            row[key + "_over_fifo"] = round(row[key] / fifo[key], 4)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "admission_sim")
    with open(path + ".json", "w") as f:
        json.dump({"target_batch": B, "rows": rows,
                   "admit_call": {"machine": "dev box (2 cores, shared)", "rows": time_admit()}}, f, indent=1)
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
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, label in ((axes[0], "workload_cv", f"workload CV, saturated steps (B = {B})"),
                           (axes[1], "pipeline_time_s_fixed_over_fifo", "balanced pipeline time / FIFO's, S fixed"),
                           (axes[2], "pipeline_time_s_linear_over_fifo", "balanced pipeline time / FIFO's, S linear")):
        for j, c in enumerate(ctls):
            for i, n in enumerate(names):
                ys = [r[key] for r in rows if r["case"] == n and r["controller"] == c]
                ax.scatter([i + (j - 1.5) * 0.18] * len(ys), ys, color=f"C{j}", label=c if i == 0 else None)
        ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=7)
        ax.set_ylabel(label)
    axes[0].set_title("admission in the simulator: 3 seeds per request set", fontsize=9)
    for ax in axes[1:]:
        ax.axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
