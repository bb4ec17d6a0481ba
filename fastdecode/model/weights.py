"""Load model weights as a dict of torch tensors with HF parameter names.

HF directories load straight from safetensors. GGUF files are dequantized with the `gguf`
package once, un-permuted (llama.cpp stores Llama's Q/K rows interleaved for its RoPE), Gemma's
norms given back their HF meaning (llama.cpp stores 1 + w), and cached as float32 safetensors under the cache dir keyed by the file's SHA-256, so a warm load
is an mmap. With fp8 weights (`--quantization fp8`, or an fp8 checkpoint) the projections come
as Fp8Weight (quantization.py).
"""
from __future__ import annotations

import glob
import hashlib
import os

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from fastdecode.model.config import ConfigError, ModelConfig
from fastdecode.model.fp8 import Fp8Weight
from fastdecode.model.gguf_meta import CONFIG_TENSORS, TOP_NAMES, block_names
from fastdecode.model.quantization import WeightCollector, WeightFormat, is_projection
from fastdecode.model.shard import Shard, column_cut, rule, take
from fastdecode.model.source import ModelSource, cache_dir


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def source_digest(source: ModelSource) -> str:
    """SHA-256 of a GGUF file, remembered per (path, size, mtime) so it is hashed once."""
    memo = os.path.join(cache_dir(), "meta", source.stat_key + ".sha256")
    try:
        with open(memo) as f:
            return f.read().strip()
    except OSError:
        digest = file_sha256(source.path)
        try:                          # a read-only cache costs the next start the hash, nothing more
            os.makedirs(os.path.dirname(memo), exist_ok=True)
            with open(memo, "w") as f:
                f.write(digest)
        except OSError:
            pass
        return digest


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute: per head, rows were reordered from (half, pair) to (pair, half)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def _gguf_to_hf_arrays(path: str, config: ModelConfig) -> dict[str, np.ndarray]:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = config.hf_config.get("gguf_arch", "llama")
    permuted = arch in ("llama", "mistral")
    names = block_names(arch)
    out = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in names:
                raise ValueError(f"{path}: unexpected GGUF tensor {t.name}")
            name = f"model.layers.{layer}.{names[rest]}"
        elif t.name in TOP_NAMES:
            name = TOP_NAMES[t.name]
        elif t.name in CONFIG_TENSORS:
            continue
        else:
            raise ValueError(f"{path}: unexpected GGUF tensor {t.name}")
        arr = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arch.startswith("gemma") and t.name.endswith("norm.weight"):
            arr = arr - 1.0      # llama.cpp stores Gemma's norms as 1 + w; HF's weight is w
        if permuted and rest_is(t.name, "attn_q."):
            arr = _unpermute_rope_rows(arr, config.num_heads)
        elif permuted and rest_is(t.name, "attn_k."):
            arr = _unpermute_rope_rows(arr, config.num_kv_heads)
        out[name] = np.ascontiguousarray(arr)
    return out


def rest_is(gguf_name: str, prefix: str) -> bool:
    return gguf_name.startswith("blk.") and gguf_name.split(".", 2)[2].startswith(prefix)


def gguf_cache_path(source: ModelSource) -> str:
    return os.path.join(cache_dir(), "weights", source_digest(source), "model.safetensors")


def _ensure_gguf_cache(source: ModelSource, config: ModelConfig) -> str:
    """The GGUF's weights dequantized into a safetensors cache (made once). Made under a lock on
    the cache's folder: the S-ranks of a tensor-parallel S-worker (and concurrent jobs) start
    together, and each would otherwise dequantize the whole model in its own memory; the first
    makes it, the others wait and then read their slices of the file."""
    import fcntl
    path = gguf_cache_path(source)
    if os.path.isfile(path):
        return path
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(os.path.join(os.path.dirname(path), ".lock"), "w")     # noqa: SIM115 - held below
    except OSError as e:
        raise ConfigError(f"{source.path}: its dequantized weights cannot be written to the cache "
                          f"{os.path.dirname(path)} ($FASTDECODE_CACHE): {e.strerror or e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)              # released when the file closes
        if os.path.isfile(path):                      # another rank or job made it meanwhile
            return path
        arrays = _gguf_to_hf_arrays(source.path, config)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            save_file(arrays, tmp)
            os.replace(tmp, path)   # atomic: a reader without the lock never sees a half-written cache
        except OSError as e:
            raise ConfigError(f"{source.path}: its dequantized weights cannot be written to the cache "
                              f"{os.path.dirname(path)} ($FASTDECODE_CACHE): {e.strerror or e}") from None
    return path


def random_weights(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0,
                   keep=None) -> dict[str, torch.Tensor]:
    """N(0, 0.02) weights (norms 1) made on the device: benchmark models of a real shape.
    keep(name, tensor): what to store for each as it is made (default: the tensor)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config
    w = {}

    def put(name, t):
        w[name] = keep(name, t) if keep is not None else t

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    put("model.embed_tokens.weight", rnd(c.vocab_size, c.hidden_size))
    put("model.norm.weight", torch.ones(c.hidden_size, device=device, dtype=dtype))
    put("lm_head.weight", rnd(c.vocab_size, c.hidden_size))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", torch.ones(c.hidden_size, device=device, dtype=dtype))
        put(p + "post_attention_layernorm.weight", torch.ones(c.hidden_size, device=device, dtype=dtype))
        put(p + "self_attn.q_proj.weight", rnd(c.q_size, c.hidden_size))
        put(p + "self_attn.k_proj.weight", rnd(c.kv_size, c.hidden_size))
        put(p + "self_attn.v_proj.weight", rnd(c.kv_size, c.hidden_size))
        put(p + "self_attn.o_proj.weight", rnd(c.hidden_size, c.q_size))
        put(p + "mlp.gate_proj.weight", rnd(c.intermediate_size, c.hidden_size))
        put(p + "mlp.up_proj.weight", rnd(c.intermediate_size, c.hidden_size))
        put(p + "mlp.down_proj.weight", rnd(c.hidden_size, c.intermediate_size))
    return w


def load_weights(source: ModelSource, config: ModelConfig, dtype: torch.dtype,
                 device: str | torch.device = "cpu", fmt: WeightFormat | None = None,
                 shard: Shard | None = None) -> dict:
    """All parameters by HF name, in `dtype` on `device`; with an fp8 `fmt` the projections as
    Fp8Weight (quantization.py: quantized as they load, or the checkpoint's own). With `shard`
    (a tensor-parallel rank) only that rank's part of each tensor, read as such from the
    safetensors (shard.py): the checkpoint is never whole in memory."""
    fmt = fmt or WeightFormat()
    collect = WeightCollector(fmt, dtype, device)
    if source.kind == "random":
        weights = random_weights(config, dtype, device, keep=lambda name, t: _keep_random(config, fmt, shard, name, t))
        return _tied_head(config, shard, weights)
    if source.kind == "gguf":
        files = [_ensure_gguf_cache(source, config)]
    else:
        files = sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                ours = our_name(config, name)
                if ours is None:
                    continue
                if shard is None:
                    collect.add(name, ours, st.get_tensor(name))
                elif _quantized_whole(config, fmt, ours, st.get_slice(name).get_dtype()):
                    whole = Fp8Weight.quantize(st.get_tensor(name).to(device))      # the whole rows' scales
                    collect.put(ours, column_cut(whole, shard, config, ours))
                else:
                    sl = st.get_slice(name)
                    collect.add(name, ours, take(config, shard, ours, tuple(sl.get_shape()), sl.__getitem__))
    return _tied_head(config, shard, collect.finish())


def _quantized_whole(config: ModelConfig, fmt: WeightFormat, ours: str, st_dtype: str) -> bool:
    """A float row-parallel projection quantized at load: quantized whole, then cut (its scales
    cover whole rows, as at T = 1)."""
    return fmt.quantize_at_load and is_projection(ours) and rule(config, ours) == "row" and \
        not st_dtype.startswith("F8")


def _keep_random(config: ModelConfig, fmt: WeightFormat, shard: Shard | None, name: str, t: torch.Tensor):
    """What a random weight keeps: its shard's part (quantized as a whole row first where fp8)."""
    fp8 = fmt.quantize_at_load and is_projection(name)
    if shard is None:
        return Fp8Weight.quantize(t) if fp8 else t
    if fp8 and rule(config, name) == "row":
        return column_cut(Fp8Weight.quantize(t), shard, config, name)
    part = take(config, shard, name, tuple(t.shape), t.__getitem__).contiguous()
    return Fp8Weight.quantize(part) if fp8 else part


def _tied_head(config: ModelConfig, shard: Shard | None, weights: dict) -> dict:
    """A tensor-parallel rank of a tied model: its LM-head rows cut from the (replicated) embedding."""
    if shard is not None and config.tie_word_embeddings:
        embed = weights["model.embed_tokens.weight"]
        weights["lm_head.weight"] = take(config, shard, "lm_head.weight", tuple(embed.shape), embed.__getitem__)
    return weights


def our_name(config: ModelConfig, name: str) -> str | None:
    """A checkpoint's tensor name -> the HF decoder name the S-part reads (model.*, lm_head.weight),
    or None for what it does not use (a multimodal checkpoint's vision tower)."""
    if config.weight_prefix == "model.":
        return name
    if name.startswith(config.weight_prefix):
        return "model." + name[len(config.weight_prefix):]
    return "lm_head.weight" if name == config.lm_head_key else None
