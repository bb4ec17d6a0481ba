"""The tensor-parallel S-worker on CPUs (gloo): the embedded model (9 query, 3 KV heads) with T = 1
(`mpiexec -n 2`: the S-worker and 1 R-worker) and T = 3 (`mpiexec -n 4`: 3 S-ranks and 1
R-worker), fp32, greedy, the same token-id prompts. The tokens must be identical; the cost of the
split is stated per decode step (the engine's own decode time over its decode steps, start-up and
prefill left out) and per step and layer. All KV on the R-worker (--no-device-kv), so the two
runs differ only in the S-worker. On a machine with fewer cores than ranks the S-ranks share
cores (the result file says how many there were): the overhead measured there is the
collectives' plus that sharing, an upper bound for a node with a core per rank.

    python3 bench/e2e/tp_cpu_bench.py --label devbox-2core     # writes results/tp_cpu_<label>.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")

# run under mpiexec: rank 0 writes the tokens and the engine's decode time; the others serve
RUN = r"""
import json, sys, time
from fastdecode import LLM, SamplingParams
reqs, out, kwargs = json.load(open(sys.argv[1])), sys.argv[2], json.loads(sys.argv[3])
t0 = time.perf_counter()
llm = LLM("smollm2-135m", **kwargs)
ready = time.perf_counter()
outs = llm.generate(reqs, SamplingParams(max_tokens=kwargs.pop("_gen", 0) or 32, temperature=0, ignore_eos=True),
                    use_tqdm=False)
rec = llm.engine.recorder
json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "decode_s": rec.decode_s,
           "decode_steps": rec.num_decode, "generate_s": time.perf_counter() - ready, "start_s": ready - t0,
           "layers": llm.engine.config.num_layers}, open(out, "w"))
llm.close()
"""


def machine() -> str:
    """The CPU's model name, its cores and whether it has AVX-512 (from /proc/cpuinfo where there is one)."""
    name, flags = platform.processor() or platform.machine(), ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        name, flags = info.get("model name", name), info.get("flags", "")
    return f"{name}, {os.cpu_count()} cores" + (", avx512" if "avx512f" in flags.split() else "")


def run(ranks: int, tp: int, prompts: list[list[int]], gen: int, tmp: str, timeout: float) -> dict:
    req, out, script = (os.path.join(tmp, f"{n}-{tp}") for n in ("req.json", "out.json", "run.py"))
    with open(req, "w") as f:
        json.dump(prompts, f)
    with open(script, "w") as f:
        f.write(RUN.replace('kwargs.pop("_gen", 0) or 32', str(gen)))
    kwargs = {"device": "cpu", "dtype": "float32", "kv_dtype": "fp32", "device_kv": False,
              "max_batch": len(prompts), "tensor_parallel_size": tp}
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, script, req, out, json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"T={tp} (mpiexec -n {ranks}) failed, exit {proc.returncode}: {proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="names the machine in the result file")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    load_before = os.getloadavg()[0]          # a shared machine's other work, stated with the result
    with tempfile.TemporaryDirectory() as tmp:
        one = run(2, 1, prompts, args.gen, tmp, args.timeout)
        three = run(4, 3, prompts, args.gen, tmp, args.timeout)
    step = {name: r["decode_s"] / max(r["decode_steps"], 1) for name, r in (("t1", one), ("t3", three))}
    overhead = step["t3"] - step["t1"]
    result = {"label": args.label, "machine": machine(),
              "load_average_1min_before": round(load_before, 2), "model": "smollm2-135m", "dtype": "float32", "prompts": args.prompts, "prompt_len": args.prompt_len,
              "gen": args.gen, "greedy_tokens_identical": one["tokens"] == three["tokens"],
              "runs": {"t1 (mpiexec -n 2)": {k: v for k, v in one.items() if k != "tokens"},
                       "t3 (mpiexec -n 4)": {k: v for k, v in three.items() if k != "tokens"}},
              "decode_step_s": step, "overhead_per_step_s": overhead,
              "overhead_per_step_and_layer_s": overhead / one["layers"]}
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"tp_cpu_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"wrote {path}")
    if not result["greedy_tokens_identical"]:
        raise SystemExit("T = 3's greedy tokens differ from T = 1's")


if __name__ == "__main__":
    main()
