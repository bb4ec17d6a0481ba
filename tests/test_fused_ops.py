"""The fused Triton kernels of the S-part against the torch code they replace.

On a machine without a GPU they run under Triton's CPU interpreter (TRITON_INTERPRET=1, set
before triton is imported); on a CUDA machine, on the GPU. Tolerances: the torch code and the
kernel round at the same places, so an output may differ only where a float32 result lands
within an ulp of a rounding boundary: one ulp of the activation dtype per rounding in the chain,
on a small share of elements. The interpreter (Triton 3.9) truncates float32 -> bf16 instead of
rounding to nearest, so there bf16 results may differ by that ulp on any element.
Outputs are poisoned with NaN first, so an element the kernel never writes fails.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from fastdecode.model import ops  # noqa: E402
from fastdecode.model import triton_ops as tri  # noqa: E402
from fastdecode.rpart.base import TorchWireLayout as WireLayout  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}   # spacing relative to the value, worst case


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, roundings: int = 1):
    """At most `roundings` ulps apart; on more than 2% of elements only where the interpreter truncates."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any(), "an output element was never written"
    o, r = out.double(), ref.double()
    tol = roundings * ULP[ref.dtype] * r.abs() + 1e-30
    bad = (o - r).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than {roundings} ulp; " \
                          f"max {float((o - r).abs().max())}"
    if not (INTERPRETED and ref.dtype == torch.bfloat16):
        differ = (o != r).double().mean().item()
        assert differ <= 0.02, f"{differ:.1%} of elements differ"


def rand(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h", [(1, 64), (7, 576), (33, 4096)])
def test_rms_norm(dtype, n, h):
    x = rand(n, h, dtype=dtype, scale=3.0)
    w = rand(h, dtype=dtype, seed=1)
    total, out = tri.rms_norm(x, w, 1e-5)
    assert total is x
    assert_within_ulps(out, ops.rms_norm_torch(x, w, 1e-5), roundings=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    n, h = 19, 960
    x, d = rand(n, h, dtype=dtype, seed=2), rand(n, h, dtype=dtype, seed=3)
    w = rand(h, dtype=dtype, seed=4)
    total, out = tri.rms_norm(x, w, 1e-6, delta=d)
    assert_within_ulps(total, x + d)                              # one rounding of the same sum
    assert_within_ulps(out, ops.rms_norm_torch(total, w, 1e-6), roundings=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 96), (5, 1536), (3, 2500)])
def test_silu_mul(dtype, n, inter):
    gu = rand(n, 2 * inter, dtype=dtype, scale=4.0, seed=5)
    gate, up = gu.chunk(2, dim=-1)
    assert_within_ulps(tri.silu_mul(gu), torch.nn.functional.silu(gate) * up, roundings=2)


@pytest.mark.parametrize("dtype,wire", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("hq,hkv,d,counts", [
    (9, 3, 64, [2, 0, 5]),          # SmolLM2-135M heads, a worker without rows
    (4, 2, 80, [3]),                # head_dim whose half is no power of two
    (8, 8, 128, [1, 4]),            # MHA
    (12, 2, 96, [6, 1, 1, 2]),
])
def test_rope_pack(dtype, wire, hq, hkv, d, counts):
    n = sum(counts)
    layout = WireLayout(counts, hq, hkv, d)
    qkv = rand(n, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=6)
    pos = torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(7))
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos()[:, None, :].to(DEVICE), emb.sin()[:, None, :].to(DEVICE)

    fused_ops, torch_ops = ops.SPartOps(DEVICE, dtype, 64), ops.SPartOps(DEVICE, dtype, 64)
    fused_ops.tri, torch_ops.tri = tri, None
    out = torch.full((layout.numel(),), float("nan"), dtype=wire, device=DEVICE)
    ref = torch.full_like(out, float("nan"))
    fused_ops.rope_pack(qkv, cos, sin, layout, out, hq, hkv, d)
    torch_ops.rope_pack(qkv, cos, sin, layout, ref, hq, hkv, d)
    assert not torch.isnan(ref).any()
    if wire == torch.float32:          # both rounded to the activation dtype first
        out, ref = out.to(dtype), ref.to(dtype)
    assert_within_ulps(out, ref)
    # v is copied, not computed: exact
    for (_, _, ov), (_, _, rv) in zip(layout.views(out), layout.views(ref)):
        torch.testing.assert_close(ov, rv, rtol=0, atol=0)


def test_wire_layout_blocks():
    layout = WireLayout([2, 0, 3], hq=4, hkv=2, d=8)
    buf = torch.arange(layout.numel(), dtype=torch.float32)
    views = layout.views(buf)
    # worker 2's block starts after worker 0's 2 rows; its k follows its 3 q rows
    assert layout.block(2) == (2 * 64, 5 * 64)
    assert views[2][1].flatten()[0].item() == 2 * 64 + 3 * 32
    off = layout.row_offsets(torch.device("cpu"))
    assert off[2].tolist() == [128, 128 + 96, 128 + 96 + 48]
    assert off[4].tolist() == [128 + 2 * 32, 128 + 96 + 2 * 16, 128 + 96 + 48 + 2 * 16]
    assert views[1][0].shape == (0, 4, 8)


def test_fused_only_where_it_pays(monkeypatch):
    monkeypatch.delenv("FASTDECODE_FUSED", raising=False)
    assert not ops.fused_enabled(torch.device("cpu"), torch.bfloat16)       # CPU: torch code
    assert not ops.fused_enabled(torch.device("cuda"), torch.float32)       # fp32: HF's exact code
    monkeypatch.setenv("FASTDECODE_FUSED", "0")
    assert not ops.fused_enabled(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv("FASTDECODE_FUSED", "1")
    assert ops.fused_enabled(torch.device("cpu"), torch.bfloat16)


def test_model_layer_fused_vs_torch():
    """A SmolLM2-shaped layer (9 q heads, 3 KV heads, hidden 576) through qkv_packed, post_attn
    and logits with the fused kernels and with the torch code: the same function (norm-wise
    within a few bf16 roundings), every packed element written."""
    from fastdecode.model.llama import LlamaSPart
    from fastdecode.model.source import read_config, resolve_model
    from fastdecode.model.weights import load_weights

    source = resolve_model("random:smollm2-135m:layers=2")
    config = read_config(source)
    weights = load_weights(source, config, torch.bfloat16, DEVICE)
    fused = LlamaSPart(config, weights, DEVICE, torch.bfloat16)
    plain = LlamaSPart(config, weights, DEVICE, torch.bfloat16)
    fused.ops.tri, plain.ops.tri = tri, None
    counts = [3, 0, 2]
    n = sum(counts)
    layout = WireLayout(counts, config.num_heads, config.num_kv_heads, config.head_dim)
    x = fused.embed_tokens(torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(8)).to(DEVICE))
    rope = fused.rope.cos_sin(torch.tensor([0, 5, 17, 300, 1023], device=DEVICE))

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    xf, xp = x, x.clone()
    for layer in range(config.num_layers):
        pf = torch.full((layout.numel(),), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        pp = torch.full_like(pf, float("nan"))
        fused.qkv_packed(layer, xf, rope, layout, pf)
        plain.qkv_packed(layer, xp, rope, layout, pp)
        assert not torch.isnan(pf).any()
        assert rel(pf, pp) < 3e-2
        o = torch.randn(n, config.num_heads, config.head_dim, generator=torch.Generator().manual_seed(layer)).to(
            torch.bfloat16).to(DEVICE)
        xf, xp = fused.post_attn(layer, xf, o), plain.post_attn(layer, xp, o)
        assert rel(xf, xp) < 3e-2
    assert rel(fused.logits(xf), plain.logits(xp)) < 3e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,ub", [(1, 64, None), (9, 5000, None), (4, 200, 3.0)])
def test_quantize_fp8_rows(dtype, n, k, ub):
    """One scale per row as fp8.quantize_rows computes it, the rows across several column tiles
    (k = 5000 > 4096), the activation bound. Under the interpreter the kernel writes the scaled
    values in float32 (its own float32 -> e4m3 cast is not the GPU's) and torch casts them."""
    from fastdecode.model.fp8 import E4M3, quantize_rows
    x = rand(n, k, dtype=dtype, scale=5.0)
    x[0, 0] = 40.0                                   # an outlier: the bound clips it to +-448
    q_ref, s_ref = quantize_rows(x, ub)
    out = torch.full((n, k), float("nan"), device=DEVICE) if INTERPRETED else None
    q, s = tri.quantize_fp8_rows(x, ub, out)
    assert torch.equal(s, s_ref)
    q = q.to(E4M3) if INTERPRETED else q
    assert q.dtype == E4M3 and torch.equal(q.float(), q_ref.float())
