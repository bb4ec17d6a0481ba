"""LLM.close() releases the engine: a closed LLM that its caller drops is collected, weights and
KV store with it (its exit hook used to keep every closed engine alive until the process ended)."""
from __future__ import annotations

import gc
import weakref


def test_a_closed_and_dropped_llm_frees_its_engine():
    from fastdecode import LLM, SamplingParams
    llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", max_batch=2)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
    engine = weakref.ref(llm.engine)
    llm.close()
    del llm
    gc.collect()
    assert engine() is None
