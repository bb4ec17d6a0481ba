"""The KV-cache's data formats as both sides count them: dtype names, their bytes and wire codes,
and the page. The one table of dtype sizes in the project (numpy only).
"""
from __future__ import annotations

import numpy as np

# bytes per element, by every name a user or a config.json gives a dtype (fp8/int8: stated
# hardware in `fastdecode plan`; the store holds only KV_DTYPES)
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "int8": 1}

KV_DTYPES = ("fp32", "bf16", "fp16")                    # what an R-worker's store holds
KV_CODES = {name: code for code, name in enumerate(KV_DTYPES)}     # in HELLO: fp32 0, bf16 1, fp16 2

# activations on the wire: float32, or bf16 as its bits in uint16
ACT_DTYPES = {0: np.float32, 1: np.uint16}
ACT_CODES = {np.dtype(dt): code for code, dt in ACT_DTYPES.items()}

PAGE_TOKENS = 32    # tokens per KV page of one (sequence, layer, kv head): the C++ store's PT


def kv_itemsize(kv_dtype: str) -> int:
    """Bytes per K or V element of a store dtype; a clear error for any other name."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return DTYPE_BYTES[kv_dtype]
