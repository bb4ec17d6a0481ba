"""Elementwise passes of the S-part: torch reference code, and fused Triton kernels where they pay.

The torch code rounds where HF transformers' Llama rounds (RMSNorm in float32, cast, then the
weight; RoPE in float32). On a CUDA S-worker in bf16/fp16 the same functions run as single
fused Triton kernels (triton_ops.py); FASTDECODE_FUSED=0 forces the torch code everywhere.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def _triton_ops():
    try:
        from fastdecode.model import triton_ops
    except Exception:      # noqa: BLE001 - no triton (CPU installs) or a broken one: torch code
        return None
    return triton_ops


def fused_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Fused kernels for this device and activation dtype? CUDA with bf16/fp16 and triton present;
    FASTDECODE_FUSED=1 also on the CPU (the Triton interpreter: tests only)."""
    flag = os.environ.get("FASTDECODE_FUSED", "auto")
    if flag == "0" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if device.type != "cuda" and flag != "1":
        return False
    return _triton_ops() is not None


# ----------------------------------------------------------------------------- torch reference code

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as HF's LlamaRMSNorm: normalize in float32, cast back, then scale
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def gemma_rms_norm_torch(x: torch.Tensor, weight1: torch.Tensor, eps: float) -> torch.Tensor:
    # as HF's Gemma RMSNorm: normalize and scale in float32 (weight1 = 1 + w, float32), then cast
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight1).to(x.dtype)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [n, H, D], cos/sin: [n, 1, R] float32 (R <= D: RoPE on the first R dims, the rest
    passed through, as HF's partial rotary) -> x rotated, in `dtype`."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return (x * cos + rotate_half(x) * sin).to(dtype)
    rot = x[..., :r]
    return torch.cat([(rot * cos + rotate_half(rot) * sin).to(dtype), x[..., r:].to(dtype)], dim=-1)


def pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, out: torch.Tensor) -> None:
    """q [n, Hq, D], k/v [n, Hkv, D] -> `out` (1-D, the wire layout of `layout`, a
    rpart.base.TorchWireLayout)."""
    for (s, e), (oq, ok, ov) in zip(layout.bounds(), layout.views(out)):
        oq.copy_(q[s:e])
        ok.copy_(k[s:e])
        ov.copy_(v[s:e])


# ----------------------------------------------------------------------------- the dispatching ops

class SPartOps:
    """The elementwise ops of one S-part (device, dtype), fused when `fused_enabled`."""

    def __init__(self, device: torch.device, dtype: torch.dtype, hidden: int):
        self.dtype = dtype
        tri = _triton_ops()
        self.tri = tri if fused_enabled(device, dtype) and hidden <= tri.MAX_FUSED_HIDDEN else None

    @property
    def fused(self) -> bool:
        return self.tri is not None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [n, h] -> RMSNorm(x) [n, h]."""
        if self.tri is not None and x.is_contiguous():
            return self.tri.rms_norm(x, weight, eps)[1]
        return rms_norm_torch(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta: [n, h] -> (x + delta, RMSNorm(x + delta))."""
        if self.tri is not None and x.is_contiguous() and delta.is_contiguous():
            return self.tri.rms_norm(x, weight, eps, delta)
        x = x + delta
        return x, rms_norm_torch(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [n, 2I] -> silu(gate) * up [n, I]."""
        if self.tri is not None and gate_up.is_contiguous():
            return self.tri.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def act_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """gate_up: [n, 2I] -> act(gate) * up [n, I] (HF's gated MLP)."""
        if act == "silu":
            return self.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[act](gate) * up

    def rope_pack(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, out: torch.Tensor,
                  hq: int, hkv: int, d: int) -> None:
        """qkv: [n, (Hq + 2 Hkv) D] projections, cos/sin: [n, 1, D] float32 -> `out` (1-D, the
        wire layout of `layout`, a rpart.base.TorchWireLayout) holds RoPE'd q, k and v."""
        n = qkv.shape[0]
        if self.tri is not None and qkv.is_contiguous():
            self.tri.rope_pack(qkv, cos.reshape(n, d), sin.reshape(n, d), layout.row_offsets(qkv.device),
                               out, hq, hkv, d)
            return
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rope(q.view(n, hq, d), cos, sin, self.dtype)
        k = apply_rope(k.view(n, hkv, d), cos, sin, self.dtype)
        pack(q, k, v.reshape(n, hkv, d), layout, out)
