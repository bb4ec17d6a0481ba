"""The new families through the whole engine in local mode (prefill, decode over the R-part's KV
store, chunked prefill's mixed steps): greedy tokens identical to HF transformers' generate on
the same random weights in float32 with fp32 KV. Only models whose decode attention is plain
causal attention with its scale (no sliding window inside the context, no soft-cap), which the
R-part has always served; q/k norms, partial and per-layer RoPE, Gemma's norms and MoE layers
are the S-part's."""
from __future__ import annotations

import pytest
from conftest import hf_greedy
from family_cases import VOCAB, build_hf, prompts, save_tokenizer

# case -> (overrides of family_cases.CASES, engine arguments)
E2E = {
    "qwen3": ({"use_sliding_window": False}, {}),
    "qwen3-chunked": ({"use_sliding_window": False}, {"max_batch": 4, "max_num_batched_tokens": 13}),
    "qwen2_moe": ({"use_sliding_window": False}, {}),
    "gemma3_text": ({"sliding_window": 512}, {}),       # windows beyond the context: plain attention
    "phi3-short": ({}, {"max_model_len": 64}),           # longrope's short factors, as HF below 64 tokens
}
STEPS = 16


@pytest.mark.parametrize("case", list(E2E))
def test_greedy_generation_matches_hf(tmp_path, case):
    from fastdecode import LLM, SamplingParams
    name = case.removesuffix("-chunked")
    overrides, engine = E2E[case]
    path, hf = build_hf(name, tmp_path, **overrides)
    save_tokenizer(path)
    ids = [p.tolist() for p in prompts([23, 40, 9], seed=3)]
    llm = LLM(path, dtype="float32", kv_dtype="fp32", device="cpu", **engine)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                            SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    for p, out in zip(ids, outs):
        # ignore_eos on our side: HF runs to the same length with an EOS it never emits
        assert out.outputs[0].token_ids == hf_greedy(hf, p, STEPS, [VOCAB + 1]), f"{case}: prompt of {len(p)}"
