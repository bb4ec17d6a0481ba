"""Under mpiexec: generate, then print from rank 0 the transport's byte counters and the rows
that crossed, as JSON (for the wire-size test)."""
import json
import sys

from fastdecode import LLM, SamplingParams

depth = int(sys.argv[1]) if len(sys.argv) > 1 else 2
llm = LLM("smollm2-135m", kv_dtype="bf16", pipeline_depth=depth)
prompts = [f"Count with me: {', '.join(str(j) for j in range(i + 1))}" for i in range(12)]
llm.generate(prompts, [SamplingParams(max_tokens=4 + i, temperature=0, ignore_eos=True) for i in range(12)],
             use_tqdm=False)
eng = llm.engine
c = eng.config
# the S-worker's own tier's rows never cross the link
tier_decode, tier_prefill = (getattr(eng.backend, name, 0) for name in ("tier_decode_rows", "tier_prefill_rows"))
print(json.dumps({"sent": eng.backend.bytes_sent, "received": eng.backend.bytes_received,
                  "decode_rows": eng.runner.decode_rows - tier_decode, "prefill_rows": eng.runner.prefill_rows - tier_prefill,
                  "tier_rows": tier_decode + tier_prefill,
                  "layers": c.num_layers, "hq": c.num_heads, "hkv": c.num_kv_heads, "d": c.head_dim,
                  "itemsize": eng.model.embed.element_size()}))
llm.close()
