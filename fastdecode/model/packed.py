"""Weights prepacked for oneDNN on a CPU S-part in bf16.

F.linear on a CPU hands a bf16 weight to oneDNN's matmul, which first reorders the weight into
its blocked layout, on every call. Packed once at start-up (`torch.ops.mkldnn._reorder_linear_weight`,
what Inductor's freezing does), the same kernel runs without that pass: 1.14-1.31x per projection
at 32-64 rows on the dev box (bench/kernel/packed_linear_bench.py), with bitwise the same outputs
(the same kernel multiplies the same values).

A PackedWeight hides the packed tensor, whose strides are oneDNN's and not a dense matrix's, so
that nothing but fp8.linear() can use it. Packed: each layer's QKV, O, gate|up and down
projections, in place; the LM head as a second copy (the embedding lookup and the float32
recomputation of the top logits read the dense one). Not packed: float32 (MKL's sgemm serves it
and the packed path gives other bits), fp16, fp8 weights, routed experts, a GPU, `--compile` (its
graphs take the dense weights as inputs), a torch without the op, and FASTDECODE_PACKED=0.
"""
from __future__ import annotations

import os

import torch

ROWS_HINT = 64          # the row count oneDNN blocks for; 1 to 1,040 rows all measured alike


class PackedWeight:
    """A [N, K] weight in oneDNN's blocked layout; only linear() reads it."""
    __slots__ = ("packed", "shape", "dtype")

    def __init__(self, w: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), ROWS_HINT)
        self.shape, self.dtype = w.shape, w.dtype

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [n, K] -> x @ W^T + bias [n, N]."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def why_not(model) -> str | None:
    """Why `model` (an SPart) keeps dense weights, or None when packing applies."""
    if os.environ.get("FASTDECODE_PACKED", "1") == "0":
        return "FASTDECODE_PACKED=0"
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return f"{model.device.type} {str(model.dtype).removeprefix('torch.')}"
    if model.fp8:
        return "fp8 weights"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch has no oneDNN weight packing"
    return None


def pack(model) -> int:
    """Pack model's dense projections in place (and a copy of its LM head) -> bytes packed."""
    packed = 0
    for L in model.layers:
        for key in ("w_qkv", "w_o"):
            L[key] = PackedWeight(L[key])
            packed += L[key].packed.numel()
        if isinstance(L["mlp"], tuple):                    # (routed experts stay as they are)
            L["mlp"] = tuple(PackedWeight(w) for w in L["mlp"])
            packed += sum(w.packed.numel() for w in L["mlp"])
    model.lm_head_packed = PackedWeight(model.lm_head)
    return (packed + model.lm_head_packed.packed.numel()) * 2
