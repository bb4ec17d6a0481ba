"""Run under mpiexec (or alone): generate with the Python API and write token ids from rank 0.

usage: generate_ids.py REQUESTS.json OUT.json [engine kwargs as JSON]
REQUESTS.json: [{"prompt": str | null, "messages": [...] | null, "prompt_ids": [int] | null,
                 "params": {SamplingParams fields}}]
engine kwargs may name the model ("model", default smollm2-135m).
"""
import json
import sys

from fastdecode import LLM, SamplingParams

requests = json.load(open(sys.argv[1]))
kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
llm = LLM(kwargs.pop("model", "smollm2-135m"), **kwargs)           # ranks 1..R serve as R-workers and exit here
tok = llm.engine.tokenizer
prompts = [r["prompt_ids"] if r.get("prompt_ids") is not None
           else tok.encode(r["prompt"]) if r.get("prompt") is not None else tok.encode_chat(r["messages"])
           for r in requests]
params = [SamplingParams(**r["params"]) for r in requests]
outs = llm.generate(prompts, params, use_tqdm=False)
workers = llm.engine.backend.workers
result = {"workers": sum(1 for w in workers if not w.tier), "tiers": [w.tier for w in workers if w.tier],
          "links": [w.link for w in workers if not w.tier],
          "placed": llm.engine.placement.placed,
          "preempted_on": {str(w): n for w, n in llm.engine.scheduler.preempted_on.items()},
          "outputs": [[c.token_ids for c in o.outputs] for o in outs],
          "texts": [[c.text for c in o.outputs] for o in outs],
          "finish": [[c.finish_reason for c in o.outputs] for o in outs],
          # per output token {token id: log-probability} (itself and the top ones), where asked for
          "logprobs": [[[{t: lp.logprob for t, lp in step.items()} for step in c.logprobs] if c.logprobs else None
                        for c in o.outputs] for o in outs],
          # per prompt token after the first {token id: log-probability}, where asked for
          "prompt_logprobs": [[{t: lp.logprob for t, lp in step.items()} for step in o.prompt_logprobs[1:]]
                              if o.prompt_logprobs else None for o in outs],
          "prefix": llm.engine.prefix_summary(), "kv_saved_bytes_peak": llm.engine.recorder.kv_saved_bytes_peak}
json.dump(result, open(sys.argv[2], "w"))
llm.close()
