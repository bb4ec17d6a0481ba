"""Weights prepacked for oneDNN (fastdecode/model/packed.py): F.linear's results, where it applies.

On the dev box (Zen 5, AVX512-BF16) the packed path gives F.linear's bits exactly (the same oneDNN
kernel); another CPU's F.linear may block its reduction otherwise, so the checks allow one bf16
rounding of the output's scale."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdecode.model import packed
from fastdecode.model.fp8 import linear
from fastdecode.model.packed import PackedWeight

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                     and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")),
                                reason="this torch cannot pack weights for oneDNN")


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal within one bf16 rounding of the output's scale."""
    assert a.shape == b.shape and a.dtype == b.dtype
    scale = b.float().abs().max().item()
    assert (a.float() - b.float()).abs().max().item() <= 2 ** -8 * scale, (a - b).abs().max()


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 36)])
def test_packed_projection_gives_f_linear_bits(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g).bfloat16()
    bias = torch.randn(shape[0], generator=g).bfloat16()
    p = PackedWeight(w)
    assert p.shape == w.shape and p.dtype == torch.bfloat16
    for rows in (1, 7, 64, 333):
        x = torch.randn(rows, shape[1], generator=g).bfloat16()
        same(linear(x, p), F.linear(x, w))
        same(linear(x, p, bias), F.linear(x, w, bias))
    wide = torch.randn(5, 2 * shape[1], generator=g).bfloat16()[:, ::2]     # a strided view of rows
    same(linear(wide, p), F.linear(wide, w))


def _spart(dtype=torch.bfloat16):
    from fastdecode.model.llama import LlamaSPart
    from fastdecode.model.source import read_config, resolve_model
    from fastdecode.model.weights import load_weights
    source = resolve_model("random:smollm2-135m:layers=2")
    config = read_config(source)
    return LlamaSPart(config, load_weights(source, config, dtype, torch.device("cpu")), "cpu", dtype)


def test_a_packed_spart_computes_the_same_layers_and_logits():
    dense, pk = _spart(), _spart()
    nbytes = packed.pack(pk)
    assert nbytes > 0 and isinstance(pk.layers[0]["w_qkv"], PackedWeight)
    assert all(isinstance(w, PackedWeight) for w in pk.layers[1]["mlp"])
    assert isinstance(pk.lm_head, torch.Tensor)          # the dense head stays for the embedding and refinement
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, dense.config.hidden_size, generator=g)
    o = torch.randn(6, dense.config.num_heads, dense.config.head_dim, generator=g).bfloat16()
    for layer in range(2):
        same(pk.qkv_proj(layer, x), dense.qkv_proj(layer, x))
        same(pk.post_attn(layer, x, o), dense.post_attn(layer, x, o))
    same(pk.logits(x), dense.logits(x))


def test_where_weights_stay_dense(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    model = type("M", (), {})
    for device, dtype, fp8, why in ((cpu, torch.float32, False, "cpu float32"), (gpu, torch.bfloat16, False, "cuda"),
                                    (cpu, torch.float16, False, "cpu float16"), (cpu, torch.bfloat16, True, "fp8")):
        m = model()
        m.device, m.dtype, m.fp8 = device, dtype, fp8
        assert why in packed.why_not(m)
    m = model()
    m.device, m.dtype, m.fp8 = cpu, torch.bfloat16, False
    assert packed.why_not(m) is None
    monkeypatch.setenv("FASTDECODE_PACKED", "0")
    assert packed.why_not(m) == "FASTDECODE_PACKED=0"
