"""The KV-cache's data formats as both sides count them: dtype names, their bytes and wire codes,
and the page. The one table of dtype sizes in the project (numpy only).
"""
from __future__ import annotations

import numpy as np

# bytes per element, by every name a user or a config.json gives a dtype (fp8: a model's weights;
# the store holds only KV_DTYPES, and fp8 KV is refused everywhere: fp8_kv_refusal)
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "int8": 1}

KV_DTYPES = ("fp32", "bf16", "fp16", "int8")            # what an R-worker's store holds
KV_CODES = {name: code for code, name in enumerate(KV_DTYPES)}     # in HELLO: fp32 0, bf16 1, fp16 2, int8 3
FP8_KV_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")           # vLLM's kv_cache_dtype names for fp8 KV


def fp8_kv_refusal(name: str) -> str | None:
    """The one message refusing fp8 KV (generate, plan, simulate and the Python API give it alike:
    no store or tier holds fp8, so no sizing may promise it); None for any other name."""
    if str(name).lower() not in FP8_KV_NAMES:
        return None
    return (f"KV dtype {name!r}: fp8 KV is not served by fastdecode (the R-workers and the S-worker's tier hold "
            f"{', '.join(KV_DTYPES)}); int8 KV (--kv-dtype int8, kv_dtype='int8': per-token scales) halves bf16's "
            f"KV bytes, as fp8 would")

# int8 KV keeps an fp32 scale per (token, kv head) for K and one for V (csrc/avx512/quant.h)
SCALE_BYTES = {"int8": 4}

# activations on the wire: float32, or bf16 as its bits in uint16
ACT_DTYPES = {0: np.float32, 1: np.uint16}
ACT_CODES = {np.dtype(dt): code for code, dt in ACT_DTYPES.items()}

PAGE_TOKENS = 32    # tokens per KV page of one (sequence, layer, kv head): the C++ store's PT


def kv_itemsize(kv_dtype: str) -> int:
    """Bytes per K or V element of a store dtype; a clear error for any other name."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return DTYPE_BYTES[kv_dtype]


def kv_elem_bytes(kv_dtype: str, head_dim: int) -> float:
    """Bytes per K or V element as the store spends them: the itemsize, and for int8 the share of
    its per-token scale (4 bytes per head_dim elements). What sizing and placement count."""
    return DTYPE_BYTES[kv_dtype] + SCALE_BYTES.get(kv_dtype, 0) / head_dim


def kv_token_bytes(kv_dtype: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of K and V of one token at one layer (int8: scales included)."""
    return 2 * num_kv_heads * (head_dim * kv_itemsize(kv_dtype) + SCALE_BYTES.get(kv_dtype, 0))
