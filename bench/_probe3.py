import json, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from fastdecode.engine import EngineArgs, LLMEngine
from fastdecode.profile import fake_sequences, median_time
from fastdecode.rpart.loopback import LoopbackBackend
from fastdecode.runner import ModelRunner
from torch.profiler import profile, ProfilerActivity
out = os.environ.get("OUT", "/tmp")
engine = LLMEngine(EngineArgs(model="random:llama-2-7b:layers=4", device="cuda", kv_dtype="bf16", max_batch=1 << 20))
m, c = engine.model, engine.config
B = 16384
seqs = fake_sequences(B, 64, c.vocab_size)

def analyze(path, tag):
    t = json.load(open(path))
    ev = [e for e in t["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
    t0 = gpu[0]["ts"]; t1 = max(e["ts"] + e["dur"] for e in gpu)
    by = {}
    for e in gpu:
        k = e["name"][:40]; by[k] = by.get(k, 0) + e["dur"]
    print(f"[{tag}] span {(t1-t0)/1e3:.1f} ms, kernels busy {sum(e['dur'] for e in gpu)/1e3:.1f} ms")
    for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {v/1e3:8.2f} ms  {k}")
    prev = None
    for e in gpu:
        if prev is not None and e["ts"] - (prev["ts"] + prev["dur"]) > 300:
            print(f"   gap {(e['ts'] - prev['ts'] - prev['dur'])/1e3:.2f} ms at {(e['ts']-t0)/1e3:.1f}: after {prev['name'][:30]} before {e['name'][:30]}")
        prev = e if prev is None or e["ts"] + e["dur"] > prev["ts"] + prev["dur"] else prev
    cpu = sorted([e for e in ev if e.get("cat") == "cpu_op" and e["dur"] > 2000], key=lambda e: -e["dur"])[:8]
    for e in cpu:
        print(f"   cpu op {e['name'][:40]} {e['dur']/1e3:.2f} ms at {(e['ts']-t0)/1e3:.1f}")

for depth in (1, 2):
    runner = ModelRunner(m, LoopbackBackend(c.num_heads, c.head_dim, m.device, m.dtype, transfers=False), engine.eos_ids, depth)
    print("depth", depth, "nocopy step ms", round(median_time(lambda: runner.decode(seqs), m.device, 5) * 1e3, 2), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.decode(seqs); torch.cuda.synchronize()
    prof.export_chrome_trace(f"{out}/trace_d{depth}.json")
    analyze(f"{out}/trace_d{depth}.json", f"depth {depth}")
