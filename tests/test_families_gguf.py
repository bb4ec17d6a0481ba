"""GGUF files of the newer families (qwen3, gemma2, gemma3, phi3), written here from tiny HF
models the way llama.cpp's converter lays them out (tensor names from the `gguf` package's own
name map, Gemma's norms stored as 1 + w, Phi-3's longrope factors as tensors), loaded by our
GGUF path: prompt logits match HF's forward on the original weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from family_cases import CASES, build_hf, load_spart, prompt_logits, prompts
from test_families_spart import PARITY_RTOL

# case -> (GGUF architecture, overrides of family_cases.CASES)
GGUF_CASES = {
    "qwen3": ("qwen3", {"use_sliding_window": False}),
    "gemma2": ("gemma2", {}),
    "gemma3_text": ("gemma3", {}),
    "phi3-long": ("phi3", {}),
}


def write_gguf(hf, arch: str, path: str) -> None:
    import gguf
    c = hf.config
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(enum, c.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    rope = c.rope_parameters
    if arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
        w.add_attention_scale(c.query_pre_attn_scalar ** -0.5)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        else:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
            w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(c.sliding_window)
        for which in ("long", "short"):
            w.add_tensor(f"rope_factors_{which}.weight", np.asarray(rope[f"{which}_factor"], dtype=np.float32))
    for name, t in hf.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        arr = t.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + 1.0                      # llama.cpp's converter stores Gemma's norms as 1 + w
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_logits_match_hf(tmp_path, name):
    arch, overrides = GGUF_CASES[name]
    _, hf = build_hf(name, tmp_path, **overrides)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(hf, arch, path)
    _, _, lengths, max_model_len = CASES[name]
    m = load_spart(path, max_model_len)
    assert m.config.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
    ids = prompts(lengths)
    ours, _ = prompt_logits(m, ids)
    start = 0
    for p in ids:
        with torch.no_grad():
            ref = hf(p[None]).logits[0]
        got = ours[start:start + len(p)]
        start += len(p)
        assert float((got - ref).abs().max()) <= PARITY_RTOL * float(ref.abs().max()), f"{name} n={len(p)}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
