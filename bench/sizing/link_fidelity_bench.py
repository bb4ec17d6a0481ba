"""Model fidelity over real links: `fastdecode plan` against runs on emulated nodes.

Each group makes an emulated cluster (scripts/emulated_nodes.py: one network namespace per rank,
TCP over shaped veths) with one link setting, then, holding /tmp/fastdecode-bench.lock for the
group alone: `fastdecode profile` over that cluster (the link as MPI sees it there), and per
configuration and pipeline depth one fixed-batch `fastdecode generate` and `fastdecode plan`
for it (fidelity_bench.py's profile, generate, predict and compare). Each group records the
link's nominal shaping, what the kernel applied, and what the profile measured (per R-worker and
to all at once), and the fabric bytes each run moved. Configurations run at depths 1 and 2 test
whether the pipeline hides the link where plan says it does. Writes
bench/sizing/results/link_fidelity_<label>.json and .png.

    python3 bench/sizing/link_fidelity_bench.py --label devbox-2core        # benchmark
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import fidelity_bench as fb  # noqa: E402

from fastdecode.launch import netns, netns_links  # noqa: E402

SMOLLM = "smollm2-135m"
KV_HEAVY = "random:smollm2-135m:layers=12:hidden=256:heads=16:kv_heads=16:intermediate=512:vocab=4096"
# name, link (a profile name or --rate), model, R-workers, configurations (B, prompt, gen), depths
GROUPS = [
    ("1gbe-r1", dict(profile="1gbe"), SMOLLM, 1, [(16, 64, 24)], [2]),
    ("1gbe-r3", dict(profile="1gbe"), SMOLLM, 3, [(48, 64, 24)], [2]),
    ("1gbe-r1-b64", dict(profile="1gbe"), SMOLLM, 1, [(64, 32, 24)], [1, 2]),     # plan: depth 2 hides the link
    ("100mbit-r1", dict(rate="100mbit"), SMOLLM, 1, [(32, 32, 24)], [1, 2]),
    ("50mbit-r1", dict(rate="50mbit"), SMOLLM, 1, [(32, 32, 24)], [1, 2]),
    ("100mbit-r2", dict(rate="100mbit"), SMOLLM, 2, [(32, 32, 24)], [2]),
    ("10gbe-r1-kvheavy", dict(profile="10gbe"), KV_HEAVY, 1, [(32, 512, 16)], [2]),
    # held out: settings the model was not revised on (--label ...-holdout --groups ho-*)
    ("ho-200mbit-r1", dict(rate="200mbit"), SMOLLM, 1, [(48, 48, 24)], [2]),
    ("ho-300mbit-r2", dict(rate="300mbit"), SMOLLM, 2, [(48, 96, 16)], [2]),
]
# the prompt grid spans the runs' prompts (a grid of the short ones alone leaves the chunk-size
# table measured at a prompt too short to price a chunk: 0.05 ms per prompt token against 6 ms run)
PROFILE_ARGS = "--repeats 2 --r-seqs 16 --link-sizes 64,16K,256K,1M,4M --prompt-lens 32,64,512"


def measured_link(profile: dict) -> dict:
    link = profile["link"]
    return {"worker_names": link["worker_names"], "worker_latency_s": link["worker_latency_s"],
            "worker_bandwidth_bit": [b * 8 for b in link["worker_bandwidth_Bps"]],
            "concurrent_bit": link["concurrent_Bps"] * 8, "hop_s": link["hop_s"]}


def fabric_bytes(name: str) -> int:
    """Bytes node 0 (the S-worker) has sent and received on the fabric so far."""
    node = netns.counters(name)["nodes"][0]["fabric"]
    return node["tx"] + node["rx"]


def run_group(args, group, result: dict) -> None:
    label, link_flags, model, r, configs, depths = group
    model = args.smollm if model == SMOLLM else model
    link = netns_links.link_from(link_flags.get("profile"), link_flags.get("rate"), None, None)
    name = args.cluster
    with netns.cluster(name, r + 1, link) as rec, fb.bench_lock():
        launcher = [sys.executable, os.path.join(fb.REPO, "scripts", "emulated_nodes.py"), "mpiexec", "--name", name]
        fargs = fb.parse_args(["--label", args.label, "--model", model, "--profile-args", PROFILE_ARGS,
                               "--token-span", "3000",                # inside the KV-heavy model's 4,096
                               "--prefill-chunk", str(args.prefill_chunk)])
        grid = ",".join(str(b) for b in sorted({1, 4} | {c[0] // d for c in configs for d in depths} | {c[0] for c in configs}))
        job = SimpleNamespace(args=fargs, launcher=launcher, engine=shlex.split(fargs.engine_args), tmp=args.tmp, grid=grid)
        t0 = time.perf_counter()
        path, speed = fb.profile(job, result, r, label)
        entry = {"group": label, "model": model, "rworkers": r, "nominal": link.as_dict(),
                 "applied": rec["shape"]["0"], "measured": measured_link(result["profiles"][label]),
                 "profile_s": round(time.perf_counter() - t0, 1)}
        result["links"].append(entry)
        print(entry, flush=True)
        for batch, prompt, gen in configs:
            for depth in depths:
                run = SimpleNamespace(**{**vars(job), "engine": job.engine + ["--pipeline-depth", str(depth)]})
                config = (batch, r, prompt, gen)
                before = fabric_bytes(name)
                summary, steps, run_speed = fb.generate(run, config)
                moved = fabric_bytes(name) - before
                plan = fb.predict(run, path, config)
                row = fb.compare(config, summary, steps, plan, dict(
                    pipeline_depth=depth, kv_reserve="full", profile=label,
                    speed_run_over_profile=round(run_speed / speed, 3)))
                row.update(group=label, model=model, fabric_bytes_s_worker=moved, **plan_fields(plan))
                result["runs"].append(row)
                print(row, flush=True)


PLAN_FIELDS = ("link_bound_by", "link_over_next", "link_exposed_s", "link_hidden", "link_hiding_depth",
               "link_balance_Bps", "link_layer_s", "s_layer_s", "r_layer_s", "layer_s")


def plan_fields(plan: dict) -> dict:
    return {k: plan[k] for k in PLAN_FIELDS}


def replan(result: dict, tmp: str) -> None:
    """Predict every run again from its group's stored profile with the model as it is now (the
    measured fields stay as they were measured)."""
    for row in result["runs"]:
        path = os.path.join(tmp, f"profile_{row['group']}.json")
        with open(path, "w") as f:
            json.dump(result["profiles"][row["group"]], f)
        job = SimpleNamespace(args=fb.parse_args(["--label", result["label"], "--prefill-chunk", str(result["prefill_chunk"])]),
                              engine=["--pipeline-depth", str(row["pipeline_depth"])])
        plan = fb.predict(job, path, (row["batch"], row["rworkers"], row["prompt_len"], row["gen_len"]))
        row.update(predicted_step_latency_s=round(plan["step_latency_s"], 5),
                   predicted_tokens_per_s=round(plan["tokens_per_s"], 3), predicted_bound=plan["bound"],
                   predicted_decode_step_s=round(plan["step_latency_s"] - plan["prefill_s"], 5), **plan_fields(plan))
        row["step_latency_error"] = round(row["predicted_step_latency_s"] / row["measured_step_latency_s"] - 1, 4)
        row["tokens_per_s_error"] = round(row["predicted_tokens_per_s"] / row["measured_tokens_per_s"] - 1, 4)
        row["decode_step_error"] = round(row["predicted_decode_step_s"] / row["measured_decode_step_s_mean"] - 1, 4)
        if "measured_full_batch_decode_step_s" in row:
            row["full_batch_decode_step_error"] = round(
                row["predicted_decode_step_s"] / row["measured_full_batch_decode_step_s"] - 1, 4)


def depth_pairs(result: dict) -> list[dict]:
    """Configurations run at depths 1 and 2: the measured and predicted speed-up of depth 2, and
    whether plan said depth 2 hides the link."""
    out = []
    for row in result["runs"]:
        if row["pipeline_depth"] != 2:
            continue
        flat = next((x for x in result["runs"] if x["group"] == row["group"] and x["pipeline_depth"] == 1
                     and x["batch"] == row["batch"] and x["prompt_len"] == row["prompt_len"]), None)
        if flat:
            out.append({"group": row["group"], "batch": row["batch"],
                        "plan_depth2_hides_link": row["link_hidden"], "plan_hiding_depth": row["link_hiding_depth"],
                        "measured_speedup": round(flat["measured_step_latency_s"] / row["measured_step_latency_s"], 3),
                        "predicted_speedup": round(flat["predicted_step_latency_s"] / row["predicted_step_latency_s"], 3),
                        "measured_decode_speedup": round(flat["measured_decode_step_s_mean"]
                                                         / row["measured_decode_step_s_mean"], 3),
                        "predicted_decode_speedup": round(flat["predicted_decode_step_s"]
                                                          / row["predicted_decode_step_s"], 3)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--cluster", default="lnkfid", help="emulated cluster name (1-8 of a-z, 0-9)")
    ap.add_argument("--groups", nargs="*", help=f"group names to run (default all: {', '.join(g[0] for g in GROUPS)})")
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--smollm", default=SMOLLM,
                    help="the model of the smollm2-135m groups: random:smollm2-135m times the same where the "
                         "embedded weights are not installed (prompts are token ids, EOS ignored)")
    ap.add_argument("--append", action="store_true", help="add the groups to the label's result file")
    ap.add_argument("--replan", action="store_true",
                    help="run nothing: predict the label's runs again from their stored profiles")
    args = ap.parse_args(argv)
    args.tmp = tempfile.mkdtemp(prefix="link-fidelity-")
    base = os.path.join(fb.RESULTS, f"link_fidelity_{args.label}")
    result = {"label": args.label, "profile_args": PROFILE_ARGS, "prefill_chunk": args.prefill_chunk,
              "links": [], "runs": [], "profiles": {}}
    if args.append or args.replan:
        with open(base + ".json") as f:
            result = json.load(f)
    if args.replan:
        replan(result, args.tmp)
        result["predictions"] = ("predicted again from each group's stored profile (--replan) by the model as "
                                 "revised after the first pass: bench/sizing/NOTES.md, 'Over real links'")
    else:
        why = netns.unavailable()
        if why:
            sys.exit(f"link_fidelity_bench: no emulated nodes here: {why}")
        for group in GROUPS:
            if not args.groups or group[0] in args.groups:
                run_group(args, group, result)
                write(result, base)          # after every group: a run cut by its time limit keeps what it finished
    errs = write(result, base)
    plot(result, base + ".png")
    print(f"wrote {base}.json; max |error| {max(errs):.1%}, {result['within_15_percent']}/{len(errs)} within 15%")


def write(result: dict, base: str) -> list:
    """Summarize the runs so far into base.json; returns the step-latency errors."""
    errs = fb.summarize(result)
    result["tokens_per_s_within_15_percent"] = sum(abs(r["tokens_per_s_error"]) <= 0.15 for r in result["runs"])
    result["depth_pairs"] = depth_pairs(result)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    return errs


def plot(result: dict, path: str) -> None:
    plt = fb.pyplot()
    if plt is None:
        return
    runs = result["runs"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 5))
    colors = {"S": "tab:blue", "R": "tab:green", "link": "tab:red", "capacity": "tab:gray"}
    meas = [r["measured_step_latency_s"] * 1e3 for r in runs]
    pred = [r["predicted_step_latency_s"] * 1e3 for r in runs]
    for r, m, p in zip(runs, meas, pred):
        ax.scatter([m], [p], color=colors[r["predicted_bound"]], marker="o" if r["pipeline_depth"] == 2 else "s")
        ax.annotate(f"{r['group']} B{r['batch']} d{r['pipeline_depth']}", (m, p), fontsize=6)
    lo, hi = min(meas + pred) * 0.8, max(meas + pred) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.15, label="±15%")
    for bound, c in colors.items():
        ax.scatter([], [], color=c, label=f"plan: {bound}-bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step latency (ms)")
    ax.set_ylabel("predicted step latency (ms)")
    ax.set_title(f"plan vs measured over emulated links: {result['label']}", fontsize=9)
    ax.legend(fontsize=7)
    pairs = result["depth_pairs"]
    x = range(len(pairs))
    bx.bar([i - 0.2 for i in x], [p["measured_decode_speedup"] for p in pairs], 0.4, label="measured")
    bx.bar([i + 0.2 for i in x], [p["predicted_decode_speedup"] for p in pairs], 0.4, label="plan")
    bx.set_xticks(list(x), [f"{p['group']}\nplan: depth 2 {'hides' if p['plan_depth2_hides_link'] else 'cannot hide'}"
                            for p in pairs], fontsize=7)
    bx.set_ylabel("decode step, depth 1 / depth 2")
    bx.set_title("does the pipeline hide the link?", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
