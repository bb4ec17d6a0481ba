"""The S-part of every served family against HF transformers' forward on the same random weights
(float32, eager attention): prompt logits within PARITY_RTOL of HF's logit scale and the greedy
choice identical at every position; a prompt in two chunks (the second attending the first's K/V
as `context`) equal to it in one; a multimodal Gemma 3 checkpoint served as its text model; and
the config errors raised before any weight is read."""
from __future__ import annotations

import json
import os

import pytest
import torch
from family_cases import CASES, build_hf, load_spart, prompt_logits, prompts

# max |ours - HF| over a prompt's logits <= PARITY_RTOL * max |HF logit|. Measured worst case
# 1.5e-5 (mixtral: rows meet the expert GEMMs in other groupings than HF's loop); SDPA-vs-eager
# and RMSNorm order differences alone are ~1e-6.
PARITY_RTOL = 1e-4
CHUNK_RTOL = 1e-5    # two chunks vs one: the same kernels over the same rows but another mask path


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_hf(name, root) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logits_match_hf(family_models, name):
    path, hf = family_models[name]
    _, _, lengths, max_model_len = CASES[name]
    m = load_spart(path, max_model_len)
    ids = prompts(lengths)
    ours, _ = prompt_logits(m, ids)
    start = 0
    for p in ids:
        with torch.no_grad():
            ref = hf(p[None]).logits[0]                                  # [n, V]
        got = ours[start:start + len(p)]
        start += len(p)
        err, scale = float((got - ref).abs().max()), float(ref.abs().max())
        assert err <= PARITY_RTOL * scale, f"{name} n={len(p)}: max |diff| {err:.3g} vs logit scale {scale:.3g}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"{name} n={len(p)}: greedy choice differs"


@pytest.mark.parametrize("name", list(CASES))
def test_two_chunks_equal_one(family_models, name):
    """Chunk 2 of prompt A (its first 30 tokens' K/V as context: windows straddle the cut) beside
    a whole prompt B in the same packed call: the same logits as A and B in one chunk each."""
    path, _ = family_models[name]
    _, _, lengths, max_model_len = CASES[name]
    m = load_spart(path, max_model_len)
    a, b = prompts([lengths[-1], lengths[0]], seed=2)
    whole, _ = prompt_logits(m, [a, b])
    _, seen = prompt_logits(m, [a[:30]])
    second, _ = prompt_logits(m, [a[30:], b], starts=[30, 0], kept=[seen[0], None])
    scale = float(whole.abs().max())
    want = torch.cat([whole[30:len(a)], whole[len(a):]])
    assert float((second - want).abs().max()) <= CHUNK_RTOL * scale


def test_config_fields_and_variants(family_models):
    from fastdecode.model.source import read_config, resolve_model
    c = {name: read_config(resolve_model(family_models[name][0])) for name in ("gemma2", "qwen2_moe", "qwen3")}
    assert c["gemma2"].layer_windows == (16, 0, 16)
    assert (c["gemma2"].attn_softcap, c["gemma2"].final_softcap, c["gemma2"].attn_scale) == (5.0, 8.0, 64 ** -0.5)
    assert c["gemma2"].attention_variants() == "sliding window 16 on 2 of 3 layers, logit soft-cap 5.0, scale 0.125"
    assert c["qwen2_moe"].layer_windows == (20, 0, 0) and c["qwen2_moe"].moe_layers == (1,)
    assert c["qwen3"].layer_windows == (0, 24, 24) and c["qwen3"].attention_variants().endswith("q/k norm")
    assert c["qwen3"].max_context == 256            # windows no longer cap the context
    d = json.loads(json.dumps(c["gemma2"].to_dict()))
    assert type(c["gemma2"]).from_dict(d) == c["gemma2"]


# ------------------------------------------------------------------ multimodal gemma3

def _multimodal_dir(root, text_path: str, prefix: str, head: str | None, tied: bool) -> str:
    """A Gemma3ForConditionalGeneration-shaped directory around the text model's weights."""
    from safetensors.torch import load_file, save_file
    text_cfg = json.load(open(os.path.join(text_path, "config.json")))
    sd = load_file(os.path.join(text_path, "model.safetensors"))
    out = {prefix + k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
    if head:
        out[head] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).clone()
    out["model.vision_tower.patch.weight"] = torch.zeros(4, 4)          # ignored
    path = root / f"mm-{prefix.strip('.').replace('.', '-')}"
    path.mkdir()
    save_file(out, str(path / "model.safetensors"))
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text_cfg,
           "vision_config": {"model_type": "siglip_vision_model"}, "tie_word_embeddings": tied}
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("prefix,head,tied", [("model.language_model.", None, True),
                                              ("language_model.model.", "language_model.lm_head.weight", False)])
def test_multimodal_gemma3_serves_its_text_model(family_models, tmp_path, prefix, head, tied):
    text_path, hf = family_models["gemma3_text"]
    path = _multimodal_dir(tmp_path, text_path, prefix, head, tied)
    m = load_spart(path)
    assert m.config.model_type == "gemma3_text" and m.config.weight_prefix == prefix
    (p,) = prompts([57])
    ours, _ = prompt_logits(m, [p])
    with torch.no_grad():
        ref = hf(p[None]).logits[0]
    assert float((ours - ref).abs().max()) <= PARITY_RTOL * float(ref.abs().max())


# ------------------------------------------------------------------ config errors

def _error(cfg: dict, where: str = "/models/x") -> str:
    from fastdecode.model.config import ConfigError, config_from_hf_dict
    with pytest.raises(ConfigError) as e:
        config_from_hf_dict(cfg, where)
    assert where in str(e.value)
    return str(e.value)


BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
        "vocab_size": 100}


def test_config_errors_name_the_directory_and_option():
    assert "'gpt_neox'" in _error({**BASE, "model_type": "gpt_neox"})
    assert "'dynamic'" in _error({**BASE, "model_type": "qwen3", "rope_scaling": {"rope_type": "dynamic", "factor": 2}})
    assert "'relu'" in _error({**BASE, "model_type": "gemma2", "hidden_activation": "relu"})
    assert "'gelu_new'" in _error({**BASE, "model_type": "llama", "hidden_act": "gelu_new"})
    assert "'su'" not in _error({**BASE, "model_type": "phi3", "rope_scaling": {"type": "su"}})   # no factors
    assert "'mrope'" in _error({**BASE, "model_type": "gemma3_text",
                                "rope_parameters": {"full_attention": {"rope_type": "mrope"}}})
    assert "bidirectional" in _error({**BASE, "model_type": "gemma3_text", "use_bidirectional_attention": True})
    assert "text model" in _error({**BASE, "model_type": "gemma3"})                      # no text_config


def test_multimodal_gemma3_with_unknown_weight_prefix_is_a_config_error(tmp_path):
    from safetensors.torch import save_file

    from fastdecode.model.config import ConfigError, read_hf_config
    save_file({"decoder.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3",
                                                      "text_config": {**BASE, "model_type": "gemma3_text"}}))
    with pytest.raises(ConfigError, match="text model") as e:
        read_hf_config(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_hub_style_gemma3_config_takes_hf_defaults_and_both_ropes():
    """A multimodal Gemma 3 config as published (its text_config names little more than sizes,
    the RoPE in the older rope_scaling form): HF's defaults fill the rest, and the two RoPE kinds
    (local 10k on sliding layers, global 1M with linear scaling) match HF's rotary embedding."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from fastdecode.model.config import config_from_hf_dict
    from fastdecode.model.rope import Rope
    text = {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 7,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 32}
    c = config_from_hf_dict({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]}, "/models/g3")
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 256, 262_208)
    assert c.layer_windows == (32, 32, 32, 32, 32, 0, 32) and c.eos_token_ids == (1, 106)
    assert c.attn_scale == 256 ** -0.5 and c.final_softcap is None and c.attn_softcap is None
    rope = Rope(c, "cpu")
    hf = Gemma3RotaryEmbedding(Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    assert rope.kind_of == (1, 1, 1, 1, 1, 0, 1)
    torch.testing.assert_close(rope.kinds[0].inv_freq, hf.full_attention_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(rope.kinds[1].inv_freq, hf.sliding_attention_inv_freq, rtol=0, atol=0)
