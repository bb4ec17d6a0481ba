"""A model's files are inputs: its config is checked for types, ranges and agreement with the
weights' own shapes before anything is sized from it.

A config sizes everything a job allocates (layers, heads, the MLP, the vocabulary, the RoPE
tables), so a value that is wrong in type or absurd in size must stop the job with a line naming
the field, its value and what the weights say, never reach an allocation, a division or a list of
a billion layers. The checks read no tensor: an HF directory's safetensors headers (or a GGUF's
tensor table, kept with its metadata) give every weight's shape. The bounds are far above any
published model, and below what a job could allocate.
"""
from __future__ import annotations

import math
import os
import re
import struct
from typing import TYPE_CHECKING

from fastdecode.model.errors import ConfigError

if TYPE_CHECKING:          # annotations only: config.py calls these checks
    from fastdecode.model.config import ModelConfig

CONFIG_MAX_BYTES = 16 << 20           # a config.json is kilobytes; one larger is not a config
SAFETENSORS_HEADER_MAX = 100 << 20    # the safetensors format's own bound on its JSON header

# integer fields: (least, most); a field left out keeps the family's default
INT_FIELDS = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 16),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "intermediate_size": (1, 1 << 18),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (2, 1 << 24),
    "original_max_position_embeddings": (2, 1 << 24),
    "sliding_window": (0, 1 << 24),          # 0 (or null): no window, as HF writes where no layer slides
    "num_experts": (1, 1 << 12),
    "num_local_experts": (1, 1 << 12),
    "num_experts_per_tok": (1, 1 << 12),
    "moe_intermediate_size": (1, 1 << 18),
    "shared_expert_intermediate_size": (1, 1 << 18),
    "decoder_sparse_step": (1, 1024),
    "max_window_layers": (0, 1024),
    "sliding_window_pattern": (1, 1024),
}
# number fields: (above, most): a finite value in (above, most]
FLOAT_FIELDS = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e12),
    "rope_local_base_freq": (0.0, 1e12),
    "partial_rotary_factor": (0.0, 1.0),
    "attn_logit_softcapping": (0.0, 1e6),
    "final_logit_softcapping": (0.0, 1e6),
    "query_pre_attn_scalar": (0.0, 1e6),
}
MAP_FIELDS = ("rope_scaling", "rope_parameters")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def load_config_json(path: str) -> dict:
    """config.json as a dict, whatever the file holds: a size bound before reading, a parser
    without recursion (a deeply nested file is an error, not a RecursionError), an object."""
    import pydantic_core
    try:
        size = os.path.getsize(path)
        if size > CONFIG_MAX_BYTES:
            raise ConfigError(f"{path}: {size:,} bytes, more than a config.json holds ({CONFIG_MAX_BYTES:,} at most)")
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{os.path.dirname(path)}: no config.json (expected an HF model directory)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        cfg = pydantic_core.from_json(data)
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: must hold a JSON object of config fields, got a {_json_type(cfg)}")
    return cfg


def check_fields(cfg: dict, where: str) -> None:
    """Each sizing field of an HF-style config (family defaults applied) has its type and a sane
    range; raise ConfigError naming the field (and its GGUF key, for a GGUF) and the value."""
    keys = cfg.get("gguf_keys") if isinstance(cfg.get("gguf_keys"), dict) else {}

    def bad(name: str, why: str):
        said = f" (GGUF {keys[name]})" if name in keys else ""
        raise ConfigError(f"{where}: {name}{said} {why}, got {_show(cfg[name])}")

    for name, (least, most) in INT_FIELDS.items():
        value = cfg.get(name)
        if value is None:
            continue
        if not _is_int(value) or not least <= value <= most:
            bad(name, f"must be an integer in [{least}, {most:,}]")
    for name, (above, most) in FLOAT_FIELDS.items():
        value = cfg.get(name)
        if value is None:
            continue
        if not _is_number(value) or not above < value <= most:
            bad(name, f"must be a finite number in ({above:g}, {most:g}]")
    for name in MAP_FIELDS:
        if cfg.get(name) is not None and not isinstance(cfg[name], dict):
            bad(name, "must be an object (or null)")
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if name not in cfg or cfg[name] is None:
            raise ConfigError(f"{where}: {name} is missing")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    if kv is not None and kv > heads:
        bad("num_key_value_heads", f"must be at most num_attention_heads ({heads})")
    if cfg.get("head_dim") is None and cfg["hidden_size"] // heads < 2:
        raise ConfigError(f"{where}: hidden_size {cfg['hidden_size']} over num_attention_heads {heads} leaves "
                          f"{cfg['hidden_size'] // heads} dims per head (head_dim is not given)")
    eos = cfg.get("eos_token_id")
    if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(_is_int(e) for e in eos))):
        bad("eos_token_id", "must be a token id or a list of them")


def check_built(conf: ModelConfig, where: str) -> None:
    """What the fields imply together, once read: a usable head size."""
    if not 2 <= conf.head_dim <= INT_FIELDS["head_dim"][1]:
        raise ConfigError(f"{where}: head_dim {conf.head_dim} is not in [2, {INT_FIELDS['head_dim'][1]}]")


# ---------------------------------------------------------------------------- against the weights

def safetensors_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in an HF directory's *.safetensors files, from their headers."""
    import pydantic_core
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in sorted(os.listdir(model_dir)):
        if not fname.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, fname)
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                (size,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
                if not 0 < size <= SAFETENSORS_HEADER_MAX:
                    raise ConfigError(f"{path}: not a safetensors file (its header length reads {size})")
                header = pydantic_core.from_json(f.read(size))
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read: {e.strerror or e}") from None
        except ValueError as e:
            raise ConfigError(f"{path}: not a safetensors file (header: {e})") from None
        if not isinstance(header, dict):
            raise ConfigError(f"{path}: not a safetensors file (its header is not an object)")
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise ConfigError(f"{path}: tensor {name} has no valid shape")
            shapes[name] = tuple(shape)
    return shapes


def decoder_shapes(conf: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The checkpoint's shapes under the decoder's HF names (a multimodal checkpoint's text model
    sits under its own prefix)."""
    if conf.weight_prefix == "model.":
        return shapes
    out = {"model." + n[len(conf.weight_prefix):]: s for n, s in shapes.items() if n.startswith(conf.weight_prefix)}
    if conf.lm_head_key in shapes:
        out["lm_head.weight"] = shapes[conf.lm_head_key]
    return out


def check_shapes(conf: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """The config against the weights: layers present, the embedding's [vocab, hidden], and each
    layer's projections [rows, cols] as the heads, head size and MLP width make them. Raise
    ConfigError naming the field, its value and the tensor that disagrees."""
    c = conf
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    missing = sorted(set(range(c.num_layers)) - layers)
    if missing:
        held = f"{len(layers)} (model.layers.{min(layers)}..{max(layers)})" if layers else "none"
        raise ConfigError(f"{where}: num_hidden_layers is {c.num_layers}, but the weights hold layers {held}: "
                          f"layer {missing[0]} is missing")

    def expect(name: str, want: tuple[int, ...], fields: str) -> None:
        got = shapes.get(name)
        if got is not None and tuple(got) != want:
            raise ConfigError(f"{where}: {fields} make {name} {list(want)}, but the weights' is {list(got)}")

    h, v = c.hidden_size, c.vocab_size
    both = f"vocab_size {v}, hidden_size {h}"
    expect("model.embed_tokens.weight", (v, h), both)
    expect("lm_head.weight", (v, h), both)
    q, kv = c.q_size, c.kv_size
    heads = f"num_attention_heads {c.num_heads} x head_dim {c.head_dim}"
    kv_heads = f"num_key_value_heads {c.num_kv_heads} x head_dim {c.head_dim}"
    mlp = f"intermediate_size {c.intermediate_size}, hidden_size {h}"
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        expect(p + "self_attn.q_proj.weight", (q, h), f"{heads}, hidden_size {h}")
        expect(p + "self_attn.k_proj.weight", (kv, h), f"{kv_heads}, hidden_size {h}")
        expect(p + "self_attn.v_proj.weight", (kv, h), f"{kv_heads}, hidden_size {h}")
        expect(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h), f"{heads}, {kv_heads}, hidden_size {h}")
        expect(p + "self_attn.o_proj.weight", (h, q), f"hidden_size {h}, {heads}")
        if i in c.moe_layers:
            continue
        expect(p + "mlp.gate_proj.weight", (c.intermediate_size, h), mlp)
        expect(p + "mlp.up_proj.weight", (c.intermediate_size, h), mlp)
        expect(p + "mlp.gate_up_proj.weight", (2 * c.intermediate_size, h), f"2 x {mlp}")
        expect(p + "mlp.down_proj.weight", (h, c.intermediate_size), mlp)


# ---------------------------------------------------------------------------- helpers

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _json_type(x) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(x), "null")


def _show(x) -> str:
    text = _json_type(x) if isinstance(x, (list, dict)) else repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
