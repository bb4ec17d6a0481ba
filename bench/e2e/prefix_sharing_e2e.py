"""Shared prefixes end to end: `mpiexec -n 2 fastdecode generate` with prefix sharing on and off
(`--no-prefix-sharing`), runs alternating, same requests, on the embedded model.

Workloads (token-id prompts cut from real text by the model's tokenizer, so lengths are exact):
  system   a 1,000-token system prompt in front of each of 256 questions of 50-200 tokens, 64
           greedy tokens each (ignore_eos);
  samples  n = 8 samples (temperature 0.8, seed per request) of 32 prompts of 300-600 tokens, 64
           tokens each.
Per run, from --stats-json: output tokens/s and wall (prefill, decode and start-up: what a user
waits for); the R-worker's attention seconds per decode step and the KV bytes its store holds
(shared pages once) per running sequence, both as medians over the decode steps that run the
whole batch; the prefix counters of the run summary. Between runs the read bandwidth of one
thread (the R-worker's), so each rate has its limit from the same run. With --profile, `fastdecode
plan` predicts the R-time per step of each run's workload from that profile (`--shared-prefix`,
`--prefix-group`), for the sizing model's check. Writes bench/e2e/results/prefix_sharing_<label>.json
and a plot beside it.

    python3 bench/e2e/prefix_sharing_e2e.py --label devbox-2core [--workloads system,samples --rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from reserve_pages_e2e import read_gbps  # noqa: E402

MODEL = "smollm2-135m"
SOURCE_TEXT = os.path.join(REPO, "docs", "design.md")     # real English text to cut prompts from


def text_ids(model: str) -> list[int]:
    """The token ids of a long real text (the project's design document), by the model's tokenizer."""
    from fastdecode.model.source import resolve_model
    from fastdecode.model.tokenizer import Tokenizer
    tok = Tokenizer(resolve_model(model), None)
    with open(SOURCE_TEXT) as f:
        return tok.encode_text(f.read())


def workload(name: str, ids: list[int], seed: int = 0) -> list[dict]:
    """Request bodies of one workload (prompts as token ids)."""
    rng = np.random.default_rng(seed)
    if name == "system":
        system = ids[:1000]
        bodies = []
        for i in range(256):
            n = int(rng.integers(50, 201))
            start = int(rng.integers(1000, len(ids) - n))
            bodies.append({"prompt": system + ids[start:start + n], "max_tokens": 64, "temperature": 0,
                           "ignore_eos": True})
        return bodies
    if name == "samples":
        bodies = []
        for i in range(32):
            n = int(rng.integers(300, 601))
            start = int(rng.integers(0, len(ids) - n))
            bodies.append({"prompt": ids[start:start + n], "max_tokens": 64, "n": 8, "temperature": 0.8,
                           "seed": i, "ignore_eos": True})
        return bodies
    raise ValueError(f"unknown workload {name!r}")


def write_batch(path: str, bodies: list[dict]) -> None:
    with open(path, "w") as f:
        for i, body in enumerate(bodies):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def run(inp: str, model: str, sharing: bool, batch: int, extra: list[str]) -> dict:
    out, stats = tempfile.mktemp(suffix=".jsonl"), tempfile.mktemp(suffix=".json")
    cmd = [shutil.which("mpiexec"), "-n", "2", sys.executable, "-m", "fastdecode", "generate", "-i", inp, "-o", out,
           "-m", model, "--quiet", "--overwrite", "--max-batch", str(batch), "--stats-json", stats] + extra
    if not sharing:
        cmd.append("--no-prefix-sharing")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    data = json.load(open(stats))
    summ = data["summary"]
    full = [s for s in data["steps"] if s.get("r_attend_s") and s["active"] == batch and s["r_attend_s"][0] > 0]
    if not full:
        raise RuntimeError("no decode step ran the whole batch: lower --max-batch or raise the request count")
    with open(out) as f:
        texts = [json.loads(line)["response"]["body"]["choices"] for line in f]
    return {"sharing": sharing, "full_batch_steps": len(full),
            "r_attend_s_per_step_median": round(float(np.median([s["r_attend_s"][0] for s in full])), 5),
            "step_s_median": round(float(np.median([s["step_s"] for s in full])), 5),
            "kv_bytes_per_seq_median": int(np.median([s["kv_bytes"][0] / s["active"] for s in full])),
            "output_tokens_per_s": summ["output_tokens_per_s"], "wall_s": summ["wall_s"],
            "prefill_s": summ.get("prefill_s"), "kv_dtype": summ.get("kv_dtype"),
            "kv_bytes_per_token": summ.get("kv_bytes_per_token"),
            "prefix": {k: summ[k] for k in summ if k.startswith("prefix_")},
            "choices": texts}


def plan_r_time(profile: str, model: str, batch: int, prompt_len: float, shared: int, group: int, gen: int) -> dict:
    """`fastdecode plan`'s R-time per decode step (all layers) for this workload from `profile`."""
    cmd = [sys.executable, "-m", "fastdecode", "plan", "--profile", profile, "--batch", str(batch),
           "--prompt-len", str(int(round(prompt_len))), "--context", str(gen), "--rworkers", "1", "--json"]
    if shared:
        cmd += ["--shared-prefix", str(shared), "--prefix-group", str(group)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    row = json.loads(proc.stdout)
    row = row[0] if isinstance(row, list) else row
    from fastdecode.model.source import read_config, resolve_model
    layers = read_config(resolve_model(model)).num_layers
    return {"r_step_s": row["r_layer_s"] * layers, "bound": row.get("bound")}


def add_plan(w: dict, profile: str, model: str) -> None:
    """plan's R-time per step for the workload with and without sharing, against the runs'."""
    sh = w["shape"]
    w["plan"] = {"profile": os.path.relpath(profile, REPO),
                 "sharing": plan_r_time(profile, model, w["sequences"], sh["prompt_len"], sh["shared"], sh["group"], 64),
                 "no_sharing": plan_r_time(profile, model, w["sequences"], sh["prompt_len"], 0, 1, 64)}
    for key, sharing in (("sharing", True), ("no_sharing", False)):
        measured = float(np.median([x["r_attend_s_per_step_median"] for x in w["runs"] if x["sharing"] == sharing]))
        w["plan"][key]["measured_r_step_s"] = measured
        w["plan"][key]["error"] = round(w["plan"][key]["r_step_s"] / measured - 1, 4)


def shape_of(name: str, bodies: list[dict]) -> dict:
    """Mean prompt length, tokens shared per sequence (whole pages) and sequences per prefix."""
    lens = [len(b["prompt"]) for b in bodies]
    if name == "system":
        return {"prompt_len": float(np.mean(lens)), "shared": 1000 // 32 * 32, "group": len(bodies)}
    return {"prompt_len": float(np.mean(lens)), "shared": int(np.mean([(n - 1) // 32 * 32 for n in lens])),
            "group": bodies[0]["n"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--workloads", default="system,samples")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", help="a `fastdecode profile` JSON of this machine: compare plan's R-time per step")
    ap.add_argument("--extra", default="", help="more generate options, one string")
    ap.add_argument("--replan", metavar="JSON", help="only redo the plan comparison of an earlier result (--profile)")
    args = ap.parse_args()
    if args.replan:
        result = json.load(open(args.replan))
        for name, w in result["workloads"].items():
            add_plan(w, args.profile, result["model"])
            print(name, w["plan"])
        with open(args.replan, "w") as f:
            json.dump(result, f, indent=1)
        return
    ids = text_ids(args.model)
    result = dict(label=args.label, host=platform.node(), model=args.model, ranks=2, rounds=args.rounds,
                  workloads={})
    for name in args.workloads.split(","):
        bodies = workload(name, ids)
        batch = sum(b.get("n", 1) for b in bodies)
        inp = tempfile.mktemp(suffix=".jsonl")
        write_batch(inp, bodies)
        runs, reads = [], []
        for r in range(args.rounds):
            for sharing in ((True, False) if r % 2 == 0 else (False, True)):
                reads.append(round(read_gbps(1), 2))
                row = run(inp, args.model, sharing, batch, args.extra.split())
                row.update(round=r, read_gbps_before=reads[-1])
                runs.append(row)
                print(f"  {name} round {r} sharing={sharing}: R {row['r_attend_s_per_step_median'] * 1e3:.1f} ms/step "
                      f"of {row['step_s_median'] * 1e3:.1f}, KV {row['kv_bytes_per_seq_median'] / 2**20:.2f} MiB/seq, "
                      f"{row['output_tokens_per_s']:.1f} tokens/s, wall {row['wall_s']:.0f} s, {row['prefix']}", flush=True)
        on = [x for x in runs if x["sharing"]]
        off = [x for x in runs if not x["sharing"]]
        same = all(a["choices"] == b["choices"] for a in on for b in off) if name == "system" else None
        for x in runs:
            x.pop("choices")
        w = dict(requests=len(bodies), sequences=batch, shape=shape_of(name, bodies), read_gbps=reads, runs=runs,
                 same_greedy_outputs=same,
                 kv_bytes_per_seq_ratio=round(np.median([b["kv_bytes_per_seq_median"] for b in off])
                                              / np.median([a["kv_bytes_per_seq_median"] for a in on]), 3),
                 r_time_ratio=round(np.median([b["r_attend_s_per_step_median"] for b in off])
                                    / np.median([a["r_attend_s_per_step_median"] for a in on]), 3),
                 tokens_per_s_ratio=round(np.median([a["output_tokens_per_s"] for a in on])
                                          / np.median([b["output_tokens_per_s"] for b in off]), 3))
        if args.profile:
            add_plan(w, args.profile, args.model)
        result["workloads"][name] = w
        print(f"{name}: KV bytes/seq {w['kv_bytes_per_seq_ratio']}x less, R time {w['r_time_ratio']}x less, "
              f"tokens/s {w['tokens_per_s_ratio']}x, same greedy outputs {same}, plan {w.get('plan')}", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"prefix_sharing_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, path[:-5] + ".png")
    print(f"wrote {path}")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["workloads"])
    metrics = [("kv_bytes_per_seq_median", "KV MiB per sequence", 2**20), ("r_attend_s_per_step_median",
               "R-worker attention ms per step", 1e-3), ("output_tokens_per_s", "output tokens/s", 1)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, title, unit) in zip(axes, metrics):
        for j, sharing in enumerate((False, True)):
            vals = [np.median([x[key] for x in result["workloads"][n]["runs"] if x["sharing"] == sharing]) / unit
                    for n in names]
            ax.bar(np.arange(len(names)) + 0.4 * j, vals, 0.4, label="sharing" if sharing else "no sharing")
        ax.set_xticks(np.arange(len(names)) + 0.2, names)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"shared prefixes, {result['model']}, mpiexec -n 2, {result['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
