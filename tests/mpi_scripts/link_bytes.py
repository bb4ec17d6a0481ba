"""Under mpiexec: greedy generation with the Python API; rank 0 writes the token ids, the
transport's payload byte counters and how many messages rank 0 sent and received while
generating (they bound the wire's per-message overhead), as JSON.

usage: link_bytes.py OUT.json N_PROMPTS MAX_TOKENS
"""
import json
import sys

from fastdecode import LLM, SamplingParams


class CountingComm:
    """rank 0's communicator, counting the point-to-point messages that pass through it."""

    def __init__(self, comm):
        self.comm, self.messages = comm, 0

    def __getattr__(self, name):
        attr = getattr(self.comm, name)
        if name not in ("Send", "Isend", "Recv", "Irecv"):
            return attr

        def counted(*args, **kwargs):
            self.messages += 1
            return attr(*args, **kwargs)
        return counted


n, max_tokens = int(sys.argv[2]), int(sys.argv[3])
llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", max_batch=4)       # ranks 1..R exit here
backend = llm.engine.backend
backend.comm = counting = CountingComm(backend.comm)
prompts = [f"Count with me: {', '.join(str(j) for j in range(i + 1))}" for i in range(n)]
outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
with open(sys.argv[1], "w") as f:
    json.dump({"outputs": [o.outputs[0].token_ids for o in outs], "workers": len(backend.workers),
               "sent": backend.bytes_sent, "received": backend.bytes_received, "messages": counting.messages}, f)
llm.close()
