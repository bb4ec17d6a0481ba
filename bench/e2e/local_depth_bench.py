"""Where S and R share a node's cores: pipeline depth 1 against 2, libgomp's spin, and busy processes beside.

Local mode (one process: the S-part's torch threads and the in-process R-part's kernel threads), the embedded
model, 64 chat prompts decoding together (generate_bench.py's texts), greedy, EOS ignored. Each configuration
runs in a fresh child process (libgomp reads GOMP_SPINCOUNT once, when torch loads): warm-up batch, then the
measured batch; the figure is output tokens/s over the measured batch (its prefill included). Configurations:
depth 1 and 2, GOMP_SPINCOUNT 2000 (fastdecode's default) and libgomp's own (unset, torch loaded before
fastdecode), with 0, 1 or 2 busy processes (a Python loop each) on the machine. Rounds interleave.

    python3 bench/e2e/local_depth_bench.py --label devbox-2core-zen5 [--rounds 2] [--new-tokens 64]

Writes bench/e2e/results/local_depth_<label>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

SPINS = {"2000": "2000", "libgomp default": None}
CHILD_TIMEOUT_S = 900


def child(depth: int, spin: str | None, new_tokens: int) -> None:
    """In the child: torch first where libgomp's own spin is measured (fastdecode then leaves it)."""
    if spin is None:
        __import__("torch")
    from fastdecode import LLM, SamplingParams
    from generate_bench import prompts
    texts = prompts(64)
    llm = LLM("smollm2-135m", quiet=True, max_batch=64, pipeline_depth=depth)
    llm.generate(texts[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(texts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"tokens": tokens, "wall_s": wall, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                      "spin_env": os.environ.get("GOMP_SPINCOUNT")}))
    llm.close()


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(depth: int, spin_name: str, hogs: int, new_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if SPINS[spin_name] is not None:
        env["GOMP_SPINCOUNT"] = SPINS[spin_name]
    procs = busy(hogs)
    try:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps([depth, SPINS[spin_name], new_tokens])],
                             capture_output=True, text=True, env=env, cwd=REPO, timeout=CHILD_TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if out.returncode != 0:
        raise SystemExit(f"depth {depth}, spin {spin_name}, {hogs} busy: child failed\n{out.stderr[-2000:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return {**rec, "tokens_per_s": rec["tokens"] / rec["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default=platform.node() or "host")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*json.loads(args.child))
        return
    from spart_breakdown import cpu_name
    configs = [(d, s, h) for h in (0, 1, 2) for s in SPINS for d in (1, 2)]
    runs: dict = {}
    for r in range(args.rounds):
        for depth, spin, hogs in configs:
            rec = measure(depth, spin, hogs, args.new_tokens)
            runs.setdefault(f"depth {depth}, spin {spin}, {hogs} busy", []).append(rec)
            print(f"round {r} depth {depth} spin {spin:16s} busy {hogs}: {rec['tokens_per_s']:7.1f} tok/s", flush=True)
    rows = []
    for key, recs in runs.items():
        depth, spin, hogs = next(c for c in configs if f"depth {c[0]}, spin {c[1]}, {c[2]} busy" == key)
        rows.append({"depth": depth, "spin": spin, "busy_processes": hogs, "dtype": recs[0]["dtype"],
                     "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in recs), 1),
                     "rounds": [round(x["tokens_per_s"], 1) for x in recs]})
    for row in rows:            # the ratio that decides the default: depth 1 over depth 2, same spin and load
        peer = next(x for x in rows if x["depth"] == 2 and x["spin"] == row["spin"]
                    and x["busy_processes"] == row["busy_processes"])
        row["x_depth2"] = round(row["tokens_per_s"] / peer["tokens_per_s"], 3)
    result = {"label": args.label, "cpu": cpu_name(), "cores": os.cpu_count(), "model": "smollm2-135m (local mode)",
              "prompts": 64, "new_tokens": args.new_tokens, "rows": rows}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"local_depth_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for row in rows:
        print(f"depth {row['depth']} spin {row['spin']:16s} busy {row['busy_processes']}: {row['tokens_per_s']:7.1f} "
              f"tok/s  x depth 2: {row['x_depth2']}")
    print("wrote", path)


if __name__ == "__main__":
    main()
