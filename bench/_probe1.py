"""First look at the GPU box: PCIe copy bandwidth and where the S-part's time goes."""
import json, os, subprocess, sys, time
import torch
out = os.environ.get("OUT", "/tmp")
res = {}
print(subprocess.run("nvidia-smi -q | grep -iE -A2 'Link (Gen|Width)' | head -20; grep -o -E 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u; lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA|L2|L3'", shell=True, capture_output=True, text=True).stdout)
dev = torch.device("cuda")
def timed(fn, n=10):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n
for mb in (16, 256):
    nb = mb << 20
    hp = torch.empty(nb, dtype=torch.uint8, pin_memory=True); hp2 = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
    hq = torch.empty(nb, dtype=torch.uint8)
    d = torch.randint(0, 255, (nb,), dtype=torch.uint8, device=dev); d2 = torch.empty_like(d)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    r = {}
    r["d2h_pinned"] = nb / timed(lambda: hp.copy_(d, non_blocking=True)) / 1e9
    r["h2d_pinned"] = nb / timed(lambda: d2.copy_(hp2, non_blocking=True)) / 1e9
    def both():
        with torch.cuda.stream(s1): hp.copy_(d, non_blocking=True)
        with torch.cuda.stream(s2): d2.copy_(hp2, non_blocking=True)
    r["bidir_each"] = nb / timed(both) / 1e9
    r["d2h_pageable"] = nb / timed(lambda: hq.copy_(d), 3) / 1e9
    r["h2d_pageable"] = nb / timed(lambda: d2.copy_(hq), 3) / 1e9
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    g = timed(lambda: a @ a, 5)
    def overlap():
        with torch.cuda.stream(s1): hp.copy_(d, non_blocking=True)
        a @ a
    r["gemm_ms"] = g * 1e3; r["gemm_plus_d2h_ms"] = timed(overlap, 5) * 1e3; r["d2h_alone_ms"] = nb / r["d2h_pinned"] / 1e6
    res[f"{mb}MB"] = {k: round(v, 2) for k, v in r.items()}
    print(mb, res[f"{mb}MB"], flush=True)
    del hp, hp2, hq, d, d2, a
torch.cuda.empty_cache()
json.dump(res, open(f"{out}/probe1.json", "w"), indent=1)

sys.path.insert(0, os.getcwd())
from fastdecode.engine import EngineArgs, LLMEngine
from fastdecode.profile import fake_sequences, median_time
from fastdecode.rpart.loopback import LoopbackBackend
from fastdecode.runner import ModelRunner
engine = LLMEngine(EngineArgs(model="random:llama-2-7b:layers=4", device="cuda", kv_dtype="bf16", max_batch=1 << 20))
m, c = engine.model, engine.config
loop = LoopbackBackend(c.num_heads, c.head_dim, m.device, m.dtype)
for B in (4096,):
    seqs = fake_sequences(B, 64, c.vocab_size)
    for depth in (1, 2):
        runner = ModelRunner(m, loop, engine.eos_ids, depth)
        t = median_time(lambda: runner.decode(seqs), m.device, 3)
        print("B", B, "depth", depth, "step ms", round(t * 1e3, 2), flush=True)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.decode(seqs); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=35, max_name_column_width=50))
    prof.export_chrome_trace(f"{out}/trace_B{B}.json")
