"""A GGUF file's metadata as an HF-style config dict (config.py reads it like a config.json),
and the GGUF tensor names of each architecture as HF parameter names (weights.py).

Architectures: llama (and mistral, written as llama), qwen2, qwen3, gemma2, gemma3 (its text
model), phi3, as the `gguf` package names them. What GGUF files leave out takes HF's defaults;
a Gemma's attention scale comes from `attention.scale` where the file has it, else
query_pre_attn_scalar = head_dim (true of Gemma 2 2B/9B and Gemma 3 up to 12B, not of the 27Bs).
"""
from __future__ import annotations

import numpy as np

from fastdecode.model.config import ConfigError

GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3": "gemma3_text", "phi3": "phi3"}

# llama.cpp tensor name (per block: blk.N.<name>) -> HF name (model.layers.N.<name>)
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# where an architecture's names mean something else
BLOCK_OVERRIDES = {
    # Gemma: post_attention_norm follows attention, ffn_norm precedes the MLP, post_ffw_norm follows it
    "gemma": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "ffn_norm.weight": "pre_feedforward_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},            # gate and up fused, gate first
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")   # read into the config
# HF config field -> its GGUF key after "<arch>.", named in the config's errors
GGUF_KEYS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
             "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
             "head_dim": "attention.key_length", "intermediate_size": "feed_forward_length",
             "vocab_size": "vocab_size", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
             "rope_theta": "rope.freq_base", "max_position_embeddings": "context_length"}


def block_names(arch: str) -> dict[str, str]:
    return {**BLOCK_NAMES, **BLOCK_OVERRIDES.get("gemma" if arch.startswith("gemma") else arch, {})}


def gguf_hf_dict(path: str) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct errors on damaged files
        raise ConfigError(f"{path}: cannot read GGUF ({type(e).__name__}: {e})") from None

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConfigError(f"{path}: unsupported GGUF architecture {arch!r}; fastdecode serves "
                          f"{', '.join(GGUF_ARCHS)}")
    heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    key_len = field(f"{arch}.attention.key_length")
    n_vocab = field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens", []))
    tensors = {t.name: t for t in reader.tensors}
    sizes_known = _positive(heads) and _positive(hidden)    # else the config's check names the field
    cfg = {
        "model_type": GGUF_ARCHS[arch],
        "hidden_size": hidden,
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv", heads),
        "head_dim": key_len or (hidden // heads if sizes_known else None),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "vocab_size": n_vocab,
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field(f"{arch}.rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0),
        "max_position_embeddings": field(f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "gguf_arch": arch,
        "gguf_keys": {name: f"{arch}.{key}" for name, key in GGUF_KEYS.items()},
        "gguf_shapes": tensor_shapes(reader.tensors, arch),
    }
    family = _gemma(field, arch, cfg) if arch.startswith("gemma") else _phi3(field, arch, cfg, tensors) \
        if arch == "phi3" else {}
    cfg.update(family)
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": field(f"{arch}.rope.scaling.factor")}
    elif scaling not in (None, "none") and "rope_scaling" not in family:
        raise ConfigError(f"{path}: GGUF rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in tensors:
        cfg["gguf_rope_freqs"] = True   # llama3-style factors stored as a tensor; weights.py applies them
    return cfg


def tensor_shapes(tensors, arch: str) -> dict[str, list[int]]:
    """HF name -> HF shape ([rows, cols]: GGUF lists dimensions innermost first) of each weight, for
    the config's check against them (config_checks.py); names it does not know are left out."""
    names, out = block_names(arch), {}
    for t in tensors:
        if t.name.startswith("blk."):
            parts = t.name.split(".", 2)
            if len(parts) < 3 or parts[2] not in names:
                continue
            name = f"model.layers.{parts[1]}.{names[parts[2]]}"
        elif t.name in TOP_NAMES:
            name = TOP_NAMES[t.name]
        else:
            continue
        out[name] = [int(d) for d in reversed(list(t.shape))]
    return out


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _gemma(field, arch: str, cfg: dict) -> dict:
    out = {"sliding_window": field(f"{arch}.attention.sliding_window")}
    scale = field(f"{arch}.attention.scale")
    out["query_pre_attn_scalar"] = round(float(scale) ** -2) if _positive(scale) else cfg["head_dim"]   # an int in HF
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = field(f"{arch}.{key}")
        if value is not None:
            out[key] = value
    if arch == "gemma3":
        pattern = field(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):         # per layer: true = sliding
            out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern:
            out["sliding_window_pattern"] = int(pattern)
        out["rope_local_base_freq"] = field(f"{arch}.rope.freq_base_swa", 10000.0)
    return {k: v for k, v in out.items() if v is not None}


def _phi3(field, arch: str, cfg: dict, tensors: dict) -> dict:
    out = {"sliding_window": field(f"{arch}.attention.sliding_window")}
    rot = field(f"{arch}.rope.dimension_count")
    if rot and not _positive(cfg["head_dim"]):
        rot = None                               # the config's check names head_dim
    if rot:
        out["partial_rotary_factor"] = rot / cfg["head_dim"]
    if "rope_factors_long.weight" in tensors:      # longrope: the factors are tensors, [R/2] each
        scaling = {"rope_type": "longrope", "rope_theta": cfg["rope_theta"]}
        for which in ("long", "short"):
            data = np.asarray(tensors[f"rope_factors_{which}.weight"].data, dtype=np.float64).ravel()
            scaling[f"{which}_factor"] = [float(x) for x in data]
        attn = field(f"{arch}.rope.scaling.attn_factor")
        if attn is not None:
            scaling["attention_factor"] = float(attn)
        if rot:
            scaling["partial_rotary_factor"] = rot / cfg["head_dim"]
        out["rope_scaling"] = scaling
        out["original_max_position_embeddings"] = field(f"{arch}.rope.scaling.original_context_length",
                                                        cfg["max_position_embeddings"])
    return {k: v for k, v in out.items() if v is not None}
