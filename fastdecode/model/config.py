"""Model configuration, read without torch so that every MPI rank can validate it cheaply.

A ModelConfig comes from an HF `config.json` or from a GGUF file's metadata. Served families:
llama (and SmolLM), mistral, qwen2, qwen3, phi3, gemma2, gemma3 (its text model), and the
mixture-of-experts qwen2_moe, qwen3_moe and mixtral: pre-norm decoders with RMSNorm, RoPE and
GQA attention; hf_families.py reads what sets each family apart. Anything else is a ConfigError
(exit code 2 at the CLI), raised here, before any weight is read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from fastdecode.model import hf_families as fam
from fastdecode.model.errors import ConfigError
from rworker.protocol.kvformat import kv_token_bytes

SUPPORTED_ARCHS = fam.SERVED
SUPPORTED_ROPE = fam.SUPPORTED_ROPE
_TUPLE_FIELDS = ("eos_token_ids", "layer_windows", "layer_types", "moe_layers")


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
    hf_config: dict = field(default_factory=dict)     # the raw (text) config, for transformers' rope helpers
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # attention variants (the R-workers apply them in decode, prompt_attention in prefill)
    layer_windows: tuple[int, ...] = ()   # [L] keys a query attends, its own included (q - k < W); 0 / (): all
    attn_softcap: float | None = None     # cap * tanh(score / cap) before the mask and softmax
    final_softcap: float | None = None    # the same on the logits
    attn_scale: float | None = None       # softmax scale; None: head_dim ** -0.5
    attn_sinks: bool = False              # learned per-head sink logits (no family here has them)
    layer_types: tuple[str, ...] = ()     # HF's per-layer "sliding_attention" / "full_attention"
    local_rope: dict = field(default_factory=dict)   # RoPE of sliding layers where it differs (gemma3)
    partial_rotary_factor: float = 1.0    # RoPE on the first fraction of each head's dims (phi3)
    hidden_act: str = "silu"              # the gated MLP's activation
    qk_norm: bool = False                 # RMSNorm over each q and k head before RoPE (qwen3, gemma3)
    gemma_norms: bool = False             # x * (1 + w) norms, also after attention and the MLP; scaled embedding
    # mixture of experts (num_experts 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()      # layers whose MLP is routed experts
    # where the decoder's weights sit in the checkpoint (a multimodal gemma3's text model: elsewhere)
    weight_prefix: str = "model."
    lm_head_key: str = "lm_head.weight"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE turns (the first ones; phi3's partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        """Longest prompt + generation we serve exactly: the model's positions (sliding-window
        layers attend their window at any length)."""
        return self.max_position

    def window(self, layer: int) -> int:
        """Keys layer `layer` attends per query (0: all)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def attention_variants(self) -> str:
        """A short description of how attention departs from plain causal attention, or ""."""
        parts = []
        windows = [w for w in self.layer_windows if w]
        if windows:
            sizes = "/".join(str(w) for w in sorted(set(windows)))
            parts.append(f"sliding window {sizes} on {len(windows)} of {len(self.layer_windows)} layers")
        if self.attn_softcap:
            parts.append(f"logit soft-cap {self.attn_softcap}")
        if self.attn_scale is not None and abs(self.attn_scale - self.head_dim ** -0.5) > 1e-12:
            parts.append(f"scale {self.attn_scale:.4g}")
        if self.qk_norm:
            parts.append("q/k norm")
        if self.attn_sinks:
            parts.append("sinks")
        return ", ".join(parts)

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The context a job serves: `requested` (vLLM's --max-model-len) if given, which may only
        shorten the model's own; a shorter one bounds each sequence's worst-case KV reservation."""
        if requested is None:
            return self.max_context
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 2:
            raise ConfigError(f"--max-model-len must be an integer >= 2, got {requested!r}")
        if requested > self.max_context:
            raise ConfigError(f"--max-model-len {requested} is longer than the model's context of "
                              f"{self.max_context} tokens (max_position_embeddings)")
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
        for f in _TUPLE_FIELDS:       # lists after JSON
            if f in d:
                d[f] = tuple(d[f])
        return cls(**d)


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def config_from_hf_dict(cfg: dict, where: str, weight_names: set[str] | None = None) -> ModelConfig:
    """Map an HF config.json dict to ModelConfig; raise ConfigError naming `where` if unsupported.
    weight_names: the checkpoint's tensor names, where the config alone cannot say where the
    decoder's weights are (a multimodal gemma3). The fields are checked (config_checks.py) before
    anything is built from them."""
    from fastdecode.model.config_checks import check_built, check_fields
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: the config must be a JSON object of fields, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    prefix, head = "model.", "lm_head.weight"
    try:
        if model_type == "gemma3":
            if not isinstance(cfg.get("text_config", {}), dict):
                raise fam.Unsupported("text_config must be an object")
            cfg, prefix, head = fam.gemma3_text_config(cfg, weight_names)
            model_type = "gemma3_text"
    except fam.Unsupported as e:
        raise ConfigError(f"{where}: {e}") from None
    if model_type not in SUPPORTED_ARCHS:
        archs = cfg.get("architectures")
        raise ConfigError(f"{where}: unsupported architecture model_type={model_type!r} {archs or ''}; "
                          f"fastdecode serves {', '.join(sorted(SUPPORTED_ARCHS + ('gemma3',)))}")
    cfg = fam.with_defaults(cfg, model_type)
    check_fields(cfg, where)
    try:
        conf = _build(cfg, model_type)
    except fam.Unsupported as e:
        raise ConfigError(f"{where}: {model_type}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever a field's shape breaks, the config is at fault
        raise ConfigError(f"{where}: malformed config ({type(e).__name__}: {e})") from None
    check_built(conf, where)
    conf.weight_prefix, conf.lm_head_key = prefix, head
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported")
    if conf.num_heads % conf.num_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {conf.num_heads} is not a multiple of num_key_value_heads")
    if conf.rotary_dim % 2 or not 0 < conf.rotary_dim <= conf.head_dim:
        raise ConfigError(f"{where}: partial_rotary_factor {conf.partial_rotary_factor} gives {conf.rotary_dim} "
                          f"rotary dims of {conf.head_dim}: not supported")
    if conf.num_experts and conf.num_experts_per_tok > conf.num_experts:
        raise ConfigError(f"{where}: num_experts_per_tok {conf.num_experts_per_tok} > {conf.num_experts} experts")
    return conf


def _build(cfg: dict, model_type: str) -> ModelConfig:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    types = fam.layer_types(cfg, model_type, layers)
    attn_softcap, final_softcap, attn_scale = fam.softcaps_and_scale(cfg, model_type)
    return ModelConfig(
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=fam.qkv_bias(cfg, model_type),
        hf_config=cfg,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
        layer_windows=fam.layer_windows(cfg, model_type, types),
        attn_softcap=attn_softcap,
        final_softcap=final_softcap,
        attn_scale=attn_scale,
        layer_types=types,
        hidden_act=fam.hidden_act(cfg, model_type),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        gemma_norms=model_type in fam.GEMMA,
        **fam.rope_fields(cfg, model_type),
        **fam.moe_fields(cfg, model_type, layers),
    )


def read_hf_config(model_dir: str) -> ModelConfig:
    """An HF directory's config.json, checked against its safetensors headers (config_checks.py)."""
    from fastdecode.model.config_checks import check_shapes, decoder_shapes, load_config_json, safetensors_shapes
    cfg = load_config_json(os.path.join(model_dir, "config.json"))
    multimodal = cfg.get("model_type") == "gemma3"        # where its decoder sits, the names say
    shapes = safetensors_shapes(model_dir) if multimodal else None
    conf = config_from_hf_dict(cfg, model_dir, set(shapes) if multimodal else None)     # the architecture first
    check_shapes(conf, decoder_shapes(conf, shapes if multimodal else safetensors_shapes(model_dir)), model_dir)
    return conf
