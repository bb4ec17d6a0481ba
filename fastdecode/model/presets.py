"""Published model shapes (their HF config.json values): `random:<shape>` models for benchmarks
and `fastdecode plan --model <shape>`. Shapes only; no weights.
"""
from __future__ import annotations


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
           vocab: int) -> dict:
    return {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": intermediate, "vocab_size": vocab, "torch_dtype": "bfloat16"}


PRESETS = {
    "llama-7b": _llama(32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-7b": _llama(32, 4096, 32, 32, 128, 11008, 32000),
    "llama-13b": _llama(40, 5120, 40, 40, 128, 13824, 32000),
    "llama-3-8b": _llama(32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": _llama(80, 8192, 64, 8, 128, 28672, 128256),
    "smollm2-135m": _llama(30, 576, 9, 3, 64, 1536, 49152),
}
