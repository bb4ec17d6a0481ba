"""What each served model family's HF `config.json` means, read without torch.

config.py builds a ModelConfig from the fields every family shares; this module reads the
family-specific ones: per-layer sliding windows, the RoPE of each layer kind, soft-caps, the
attention scale, q/k norms, Gemma's norms, mixture-of-experts layers, and the text model inside
a multimodal Gemma 3 checkpoint. Defaults are HF transformers' (5.24) class defaults, which
apply where a config.json leaves a field out. An option we cannot serve raises Unsupported,
which config.py reports as a ConfigError naming the model directory.
"""
from __future__ import annotations

import json
import os
import struct

GEMMA = ("gemma2", "gemma3_text")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral")
SERVED = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma2", "gemma3_text",
          "phi3")
# rope types we compute ourselves (default) or through transformers' ROPE_INIT_FUNCTIONS
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope")
# MLP activations (HF's hidden_act / hidden_activation names) the S-part computes
SUPPORTED_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")

# HF's class defaults where a family's config.json may rely on them (a multimodal Gemma 3's
# text_config names little more than its sizes) or they differ from the generic ones
_GEMMA = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
          "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
          "bos_token_id": 2, "eos_token_id": 1}
_DEFAULTS = {
    "gemma2": {**_GEMMA, "vocab_size": 256000, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_GEMMA, "vocab_size": 262_208, "max_position_embeddings": 131_072},
    "qwen3": {"head_dim": 128},
    "mistral": {"sliding_window": 4096},
    "mixtral": {"rms_norm_eps": 1e-5},
    "phi3": {"rms_norm_eps": 1e-5},
}


class Unsupported(ValueError):
    """A config option the S-part cannot serve; config.py adds the model directory."""


def with_defaults(cfg: dict, model_type: str) -> dict:
    return {**_DEFAULTS.get(model_type, {}), **cfg}


def hidden_act(cfg: dict, model_type: str) -> str:
    # Gemma's modeling files read hidden_activation (a hidden_act there is ignored)
    act = cfg.get("hidden_activation") if model_type in GEMMA else cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTS:
        raise Unsupported(f"activation {act!r} is not supported (supported: {', '.join(SUPPORTED_ACTS)})")
    return "silu" if act == "swish" else act


def qkv_bias(cfg: dict, model_type: str) -> bool:
    if model_type == "qwen2":
        return True                                  # always, whatever attention_bias says
    if model_type == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))
    return bool(cfg.get("attention_bias", False))


# ------------------------------------------------------------------ attention layout per layer

def layer_types(cfg: dict, model_type: str, layers: int) -> tuple[str, ...]:
    """HF's layer_types: per layer "sliding_attention" or "full_attention" (as its configs derive
    them where config.json has none)."""
    given = cfg.get("layer_types")
    if given is not None:
        if len(given) != layers or any(t not in ("sliding_attention", "full_attention") for t in given):
            raise Unsupported(f"layer_types {given!r} (expected {layers} of sliding_attention / full_attention)")
        return tuple(given)
    if model_type in ("qwen2", "qwen3"):
        slides = [bool(cfg.get("use_sliding_window")) and i >= int(cfg.get("max_window_layers", 28))
                  for i in range(layers)]
    elif model_type == "qwen2_moe":
        slides = [bool(cfg.get("use_sliding_window")) and bool((i + 1) % 2) and i < int(cfg.get("max_window_layers", 28))
                  for i in range(layers)]
    elif model_type in GEMMA:
        pattern = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern",
                                                                cfg.get("_sliding_window_pattern", 6)))
        slides = [bool((i + 1) % pattern) for i in range(layers)]
    else:          # llama, mistral, mixtral, phi3, qwen3_moe: one window (or none) on every layer
        slides = [False] * layers
    return tuple("sliding_attention" if s else "full_attention" for s in slides)


def layer_windows(cfg: dict, model_type: str, types: tuple[str, ...]) -> tuple[int, ...]:
    """Per layer the keys a query attends, its own included (HF's mask: q - k < sliding_window);
    0 = all; () where no layer slides."""
    window = int(cfg.get("sliding_window") or 0)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = 0                                   # their configs drop the window unless it is used
    if model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):
        windows = (window,) * len(types)             # the mask is sliding on every layer
    else:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def softcaps_and_scale(cfg: dict, model_type: str) -> tuple[float | None, float | None, float | None]:
    """(attention logit soft-cap, final logit soft-cap, attention scale or None for head_dim**-0.5)."""
    if model_type not in GEMMA:
        return None, None, None
    if cfg.get("use_bidirectional_attention"):
        raise Unsupported("use_bidirectional_attention=true (an encoder) is not supported")
    scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
    final = cfg.get("final_logit_softcapping")
    # HF's Gemma 3 attention never passes attn_logit_softcapping on to the attention function, so
    # a Gemma 3 config's value changes nothing there; we follow it
    attn = cfg.get("attn_logit_softcapping") if model_type == "gemma2" else None
    return (float(attn) if attn else None), (float(final) if final else None), scale


# ------------------------------------------------------------------ RoPE

def _rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default")) or "default"


def rope_fields(cfg: dict, model_type: str) -> dict:
    """rope_type, rope_theta, rope_params (the global/only RoPE), local_rope (Gemma 3's sliding
    layers) and partial_rotary_factor (Phi-3)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local: dict = {}
    if model_type == "gemma3_text":
        if "full_attention" in params or "sliding_attention" in params:       # transformers v5 layout
            glob = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:     # older layout: rope_theta / rope_scaling for global layers, rope_local_base_freq for local
            glob = dict(cfg.get("rope_scaling") or {})
        glob.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        local["rope_type"] = _rope_type(local)
        params = glob
    params = dict(params)
    rope_type = _rope_type(params)
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"                       # HF's Phi-3 reads these old names as longrope
    for kind in (rope_type, local.get("rope_type", "default")):
        if kind not in SUPPORTED_ROPE:
            raise Unsupported(f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(params.get(key), list):
                raise Unsupported(f"rope type 'longrope' without a {key} list")
    partial = 1.0
    if model_type == "phi3":
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return {"rope_type": rope_type, "rope_theta": float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            "rope_params": params, "local_rope": local, "partial_rotary_factor": partial}


# ------------------------------------------------------------------ mixture of experts

def moe_fields(cfg: dict, model_type: str, layers: int) -> dict:
    """The routed-expert layers and their sizes; {} for dense families."""
    if model_type not in MOE:
        return {}
    # qwen3_moe and mixtral name the count either way (HF maps num_experts to num_local_experts)
    named = cfg.get("num_local_experts", cfg.get("num_experts"))
    if model_type == "mixtral":
        experts, top_k = int(named or 8), int(cfg.get("num_experts_per_tok", 2))
        return {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": int(cfg["intermediate_size"]), "moe_layers": tuple(range(layers))}
    experts = int(cfg.get("num_experts", 60) if model_type == "qwen2_moe" else (128 if named is None else named))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return {"num_experts": experts, "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 4 if model_type ==
                                                                      "qwen2_moe" else 8)),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 1408 if model_type == "qwen2_moe" else 768)),
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size", 5632))
            if model_type == "qwen2_moe" else 0,
            "moe_layers": sparse}


# ------------------------------------------------------------------ multimodal Gemma 3

# where a Gemma3ForConditionalGeneration checkpoint keeps its text decoder: (decoder prefix, LM head)
GEMMA3_TEXT_PREFIXES = (("model.language_model.", "lm_head.weight"),                   # transformers v5
                        ("language_model.model.", "language_model.lm_head.weight"))    # earlier releases


def gemma3_text_config(cfg: dict, weight_names: set[str] | None) -> tuple[dict, str, str]:
    """A multimodal gemma3 config -> (its text config as a gemma3_text config, the decoder's weight
    prefix, the LM head's name); Unsupported unless it has a text_config and its weights sit under
    one of GEMMA3_TEXT_PREFIXES (weight_names None: not checked, the v5 layout assumed)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise Unsupported("model_type 'gemma3' (multimodal) has no text_config; serve its text model instead "
                          "(Gemma3ForCausalLM, model_type 'gemma3_text')")
    text = {**text, "model_type": "gemma3_text"}
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    if weight_names is None:
        return text, *GEMMA3_TEXT_PREFIXES[0]
    for prefix, head in GEMMA3_TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in weight_names:
            return text, prefix, head
    raise Unsupported("model_type 'gemma3' (multimodal): its text model's weights are not under "
                      f"{' or '.join(p for p, _ in GEMMA3_TEXT_PREFIXES)}; serve the text model instead "
                      "(Gemma3ForCausalLM, model_type 'gemma3_text')")


def safetensors_names(model_dir: str) -> set[str]:
    """Tensor names of an HF directory's safetensors files: from the shard index where there is
    one, else from each file's JSON header (no tensor is read)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f).get("weight_map", {}))
    names: set[str] = set()
    for fname in sorted(os.listdir(model_dir)):
        if fname.endswith(".safetensors"):
            with open(os.path.join(model_dir, fname), "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                names |= set(json.loads(f.read(size))) - {"__metadata__"}
    return names
