"""Causal prompt attention by the kernel modules' own pass (csrc/avx512/prefill.h) where it applies:
bf16 query, key and value on the CPU, head dims a multiple of 16, a CPU with AVX512-BF16 (the
module's runtime check). Elsewhere `causal` returns None and the caller runs torch's SDPA.

Its precision is SDPA's for bf16 on the CPU: fp32 scores of exact bf16 products, fp32 softmax,
probabilities rounded to bf16 for the product with V. Its work runs on the kernel module's own
thread pool, sized to torch's thread count.

    FASTDECODE_PROMPT_KERNEL=0   SDPA everywhere (for measurements and comparisons)
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

_kernel: Callable | None | bool = None        # the module's function; False: not here


def _load() -> Callable | bool:
    global _kernel
    if _kernel is None:
        _kernel = False
        if os.environ.get("FASTDECODE_PROMPT_KERNEL", "").strip() != "0":
            try:
                from rworker import isa
                _kernel = getattr(isa.load(), "prompt_attention", False)
            except (ImportError, ValueError):      # no kernel module built, or FASTDECODE_ISA unknown
                _kernel = False
    return _kernel


def available() -> bool:
    """Whether this install's kernel module has the pass (the CPU's own check comes with a call)."""
    return bool(_load())


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rows: int = 48) -> torch.Tensor | None:
    """q: [n, Hq, D], k/v: [p + n, Hkv, D] (token-major; query i at position p + i) -> o [n, Hq, D],
    or None where the pass does not apply (dtype, device, shape, or a CPU without AVX512-BF16)."""
    fn = _load()
    if not fn or q.device.type != "cpu" or not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return None
    n, hq, d = q.shape
    t, hkv = k.shape[0], k.shape[1]
    if d % 16 or hq % hkv or t < n or v.shape != k.shape or k.shape[2] != d:
        return None
    q, k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (q, k, v))
    out = torch.empty(n, hq, d, dtype=torch.bfloat16)
    done = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
              n, t - n, hq, hkv, d, scale, torch.get_num_threads(), rows)
    return out if done else None
