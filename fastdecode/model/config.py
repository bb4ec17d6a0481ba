"""Model configuration, read without torch so that every MPI rank can validate it cheaply.

A ModelConfig comes from an HF `config.json` or from a GGUF file's metadata. Only the
Llama family is served (llama, mistral, qwen2, SmolLM): pre-norm decoder, RMSNorm, RoPE,
GQA attention, SwiGLU MLP. Anything else is a ConfigError (exit code 2 at the CLI).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rworker.protocol.kvformat import kv_token_bytes

SUPPORTED_ARCHS = {
    # model_type -> QKV projections carry a bias
    "llama": False,
    "mistral": False,
    "qwen2": True,
}
# rope types we compute ourselves (default) or through transformers' ROPE_INIT_FUNCTIONS
SUPPORTED_ROPE = {"default", "linear", "llama3", "yarn"}


class ConfigError(ValueError):
    """The model cannot be served: missing files, unknown architecture, unsupported option."""


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_type: str = "default"
    rope_params: dict = field(default_factory=dict)   # everything of rope_scaling/rope_parameters
    hf_config: dict = field(default_factory=dict)     # the raw config, for transformers' rope helpers
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """Longest prompt + generation we serve exactly (a sliding window caps full attention)."""
        if self.sliding_window:
            return min(self.max_position, self.sliding_window)
        return self.max_position

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The context a job serves: `requested` (vLLM's --max-model-len) if given, which may only
        shorten the model's own; a shorter one bounds each sequence's worst-case KV reservation."""
        if requested is None:
            return self.max_context
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 2:
            raise ConfigError(f"--max-model-len must be an integer >= 2, got {requested!r}")
        if requested > self.max_context:
            raise ConfigError(f"--max-model-len {requested} is longer than the model's context of "
                              f"{self.max_context} tokens (max_position_embeddings"
                              f"{' / sliding_window' if self.sliding_window else ''})")
        return requested

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V bytes of one token over all layers in an R-worker store of kv_dtype (int8: its
        per-token scales included)."""
        return self.num_layers * kv_token_bytes(kv_dtype, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def config_from_hf_dict(cfg: dict, where: str) -> ModelConfig:
    """Map an HF config.json dict to ModelConfig; raise ConfigError naming `where` if unsupported."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHS:
        archs = cfg.get("architectures")
        raise ConfigError(f"{where}: unsupported architecture model_type={model_type!r} {archs or ''}; "
                          f"fastdecode serves {', '.join(sorted(SUPPORTED_ARCHS))}")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        use_sw = cfg.get("use_sliding_window", model_type == "mistral")
        conf = ModelConfig(
            model_type=model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=SUPPORTED_ARCHS[model_type] or bool(cfg.get("attention_bias", False)),
            rope_type=rope_type,
            rope_params=dict(rope),
            hf_config=cfg,
            sliding_window=int(cfg["sliding_window"]) if use_sw and cfg.get("sliding_window") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: malformed config ({type(e).__name__}: {e})") from None
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act={cfg.get('hidden_act')!r} is not supported (SwiGLU/silu only)")
    if conf.rope_type not in SUPPORTED_ROPE:
        raise ConfigError(f"{where}: rope type {conf.rope_type!r} is not supported "
                          f"(supported: {', '.join(sorted(SUPPORTED_ROPE))})")
    if conf.num_heads % conf.num_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads")
    return conf


def read_hf_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{model_dir}: no config.json (expected an HF model directory)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_hf_dict(cfg, model_dir)
