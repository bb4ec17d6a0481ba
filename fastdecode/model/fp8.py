"""fp8 weights: float8_e4m3fn with one float32 scale per output channel (`--quantization fp8`).

A projection's weight W [out, in] is stored as q = round(W / s) in e4m3 with s[r] = max|W[r, :]| /
448 (448 is e4m3's largest finite value, so each row's largest weight lands on it), rounded to
nearest even and saturated at +-448. W is recovered as q * s. Rows are independent, so fused
projections (Q|K|V, gate|up) are the concatenation of their parts' rows and scales, exactly.

`linear(x, w, b)` is the one place the S-part applies a weight: a plain tensor goes to F.linear,
a PackedWeight (packed.py: bf16 on a CPU, in oneDNN's layout) to its oneDNN kernel, an Fp8Weight runs the path fp8_gemm.py picked for the device and activation dtype: e4m3
activations with one scale per token (row) into torch._scaled_mm on GPUs with fp8 GEMMs, or the
weight dequantized to the activation dtype everywhere else:
- on a GPU without fp8 GEMMs at each use: fp8 is chosen there to halve the weights' memory, and
  a copy kept in the compute dtype would hold exactly the bytes it saves; the copy lives for
  one GEMM only (one matrix at a time), and the card converts at its memory bandwidth;
- on a CPU once, at load, kept beside the e4m3 values (`dense`): torch converts e4m3 to float
  element by element on a CPU (~2.5 ns each, 10x a decode step's GEMM of the same weight on
  the dev box), and a CPU S-worker's weights are small against its host's memory. The outputs
  are the same either way: the same values multiply.

Shapes: n = rows (tokens), K = in features, N = out features; a stacked weight (MoE experts)
carries leading dims [E, N, K] with scales [E, N].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdecode.model import fp8_gemm
from fastdecode.model.fp8_format import (  # noqa: F401  (the weight and its helpers, imported from here)
    E4M3,
    E4M3_MAX,
    MIN_AMAX,
    Fp8Weight,
    Weight,
    cat_out,
    dequantize,
    quantize_rows,
    stack,
    weight_bytes,
)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [n, K], w: [N, K] (a tensor, a PackedWeight or an Fp8Weight) -> x @ w^T + bias [n, N]."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, Fp8Weight):
        return fp8_gemm.fp8_linear(x, w, bias)
    return w.apply(x, bias)
