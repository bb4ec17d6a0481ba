"""fp8 weights (fastdecode/model/fp8.py, fp8_gemm.py) against float references.

The reference rounding here is written out independently of torch's float8 cast: every finite
e4m3 value is listed from its bit pattern, and a value rounds to the nearest of them, a tie to
the one with an even code (even mantissa), anything past 448 to +-448.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdecode.model import fp8_gemm
from fastdecode.model.fp8 import E4M3, Fp8Weight, cat_out, dequantize, linear, quantize_rows, stack

HAS_CPU_SCALED_MM = hasattr(torch, "_scaled_mm")
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """(values float64 [254], codes [254]) of every finite e4m3fn number, from its bits: sign,
    4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN."""
    values, codes = [], []
    for code in range(256):
        sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            continue
        mag = (man / 8) * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        values.append(-mag if sign else mag)
        codes.append(code)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes)


def ref_round(v: torch.Tensor) -> torch.Tensor:
    """v float64 -> the nearest finite e4m3 value (ties to an even code), saturating at +-448."""
    values, codes = e4m3_table()
    v = v.double().clamp(-448, 448).reshape(-1, 1)
    dist = (v - values).abs()                                          # [n, 254]
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    # among the nearest, prefer an even code (0.0 and -0.0 both even: the same value)
    pick = torch.where(tied & (codes % 2 == 0), 1, 0) + tied.to(torch.int64)
    return values[pick.argmax(dim=1)]


def test_the_table_is_torchs_format():
    values, codes = e4m3_table()
    assert values.max() == 448 and torch.equal(values.float(), codes.to(torch.uint8).view(E4M3).float())


def test_quantize_rows_against_float_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-4, 2, 24)[:, None]    # rows of every magnitude
    q, scale = quantize_rows(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (24,)
    assert torch.equal(scale, w.abs().amax(dim=1) / 448)                        # per output channel
    assert torch.equal(q.double(), ref_round(w.double() / scale.double()[:, None]).reshape(q.shape))
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((24,), 448.0))  # each row's max hits 448
    # e4m3's rounding: within half a step, 2^-4 of the value, or half the subnormal step 2^-10
    err = (dequantize(q, scale, torch.float64) - w.double()).abs()
    assert bool((err <= w.double().abs() / 16 + 2.0 ** -10 * scale.double()[:, None] * (1 + 1e-6)).all())


def test_ties_round_to_even_and_halves_of_the_smallest_step_to_zero():
    # the row's max 448 makes the scale 1: the values below sit exactly between two e4m3 values
    row = torch.tensor([[448.0, 1.0625, 1.1875, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10, -1.0625]])
    q, scale = quantize_rows(row)
    assert float(scale) == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 16.0, 20.0, 0.0, 2.0 ** -8, -1.0]]


def test_saturation_at_448_with_an_activation_bound():
    x = torch.tensor([[1000.0, 10.0, -2000.0, 0.5]])
    q, scale = quantize_rows(x, amax_ub=100.0)          # fbgemm's cap: the scale from 100, not 2000
    assert float(scale) == pytest.approx(100 / 448)
    assert q.float().tolist() == ref_round(x / scale[:, None]).reshape(1, -1).float().tolist()
    assert q.float()[0, 0] == 448 and q.float()[0, 2] == -448                       # saturated, not NaN


def test_zero_rows_and_dequantize_in_each_dtype():
    w = torch.randn(4, 32)
    w[2] = 0
    fw = Fp8Weight.quantize(w)
    assert torch.isfinite(fw.scale).all() and not fw.q.float()[2].any()
    exact = fw.q.double() * fw.scale.double()[:, None]
    # one rounding of the product: 4 significant bits times 24 need up to 28
    torch.testing.assert_close(fw.dequantize(torch.float32).double(), exact, rtol=2.0 ** -24, atol=0)
    for dtype in (torch.bfloat16, torch.float16):
        d = fw.dequantize(dtype)
        assert d.dtype == dtype
        torch.testing.assert_close(d.double(), exact, rtol=2 * 2.0 ** -8, atol=0)   # two bf16 roundings


def quantized_input_reference(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """What the fp8 GEMM computes: x quantized per token and w, both dequantized, in float64."""
    xq, xs = quantize_rows(x, w.act_amax_ub)
    return (xq.double() * xs.double()[:, None]) @ w.dequantize(torch.float64).t()


def test_dequantize_path_is_the_float_gemm_of_the_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(7, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    fw = Fp8Weight.quantize(w)
    with fp8_gemm.forced_path("dequant"):
        assert torch.equal(linear(x, fw, b), F.linear(x, fw.dequantize(torch.float32), b))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))                  # a plain tensor: F.linear
    rel = (linear(x, fw) - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 0 < rel < 0.05


@pytest.mark.skipif(not HAS_CPU_SCALED_MM, reason="this torch has no _scaled_mm")
@pytest.mark.parametrize("kind", ["rowwise", "tensorwise"])
def test_scaled_mm_paths_on_torchs_cpu_kernel(kind):
    """The _scaled_mm call as the GPU makes it (operand layout, scale shapes, epilogue), on
    torch's CPU kernel: per-token activation scales, per-channel weight scales, the bias."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 64, generator=g) * torch.logspace(-2, 2, 9)[:, None]    # tokens of every size
    fw = Fp8Weight.quantize(torch.randn(32, 64, generator=g))
    b = torch.randn(32, generator=g)
    ref = quantized_input_reference(x, fw) + b.double()
    try:
        y = fp8_gemm.fp8_linear(x, fw, b, fp8_gemm.Fp8Path(kind, "test"))
    except RuntimeError as e:
        pytest.skip(f"torch's CPU _scaled_mm does not take this form: {e}")
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # padded rows (builds that want multiples of 16) are cut off again
    y_pad = fp8_gemm.fp8_linear(x, fw, b, fp8_gemm.Fp8Path(kind, "test", pad_rows=True))
    assert y_pad.shape == (9, 32)
    torch.testing.assert_close(y_pad, y, rtol=1e-6, atol=1e-6 * float(y.abs().max()))   # another blocking
    assert fp8_gemm.fp8_linear(x[:0], fw, b, fp8_gemm.Fp8Path(kind, "test")).shape == (0, 32)


@pytest.mark.skipif(not HAS_CPU_SCALED_MM, reason="this torch has no _scaled_mm")
def test_activation_bound_and_unaligned_shapes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g)
    x[1, 3] = 500.0                                         # an outlier past the bound saturates
    fw = Fp8Weight(*quantize_rows(torch.randn(32, 64, generator=g)), act_amax_ub=4.0)
    path = fp8_gemm.Fp8Path("rowwise", "test")
    torch.testing.assert_close(fp8_gemm.fp8_linear(x, fw, None, path).double(), quantized_input_reference(x, fw),
                               rtol=1e-5, atol=1e-3)
    # 40 input features are not a multiple of 16: that weight takes the dequantize path
    odd = Fp8Weight.quantize(torch.randn(32, 40, generator=g))
    x40 = torch.randn(5, 40, generator=g)
    assert torch.equal(fp8_gemm.fp8_linear(x40, odd, None, path), x40 @ odd.dequantize(torch.float32).t())


def test_the_probe_accepts_a_right_product_and_names_a_wrong_one(monkeypatch):
    cpu = torch.device("cpu")
    if HAS_CPU_SCALED_MM:
        assert fp8_gemm._probe(fp8_gemm.Fp8Path("rowwise", "t"), cpu, torch.float32) is None
    real = fp8_gemm.fp8_linear

    def off_by_a_tenth(x, w, bias=None, path=None):
        return real(x, w, bias, fp8_gemm.Fp8Path("dequant", "t")) * 1.1
    monkeypatch.setattr(fp8_gemm, "fp8_linear", off_by_a_tenth)
    assert "relative error" in fp8_gemm._probe(fp8_gemm.Fp8Path("rowwise", "t"), cpu, torch.float32)

    def fails(*a, **k):
        raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling")
    monkeypatch.setattr(fp8_gemm, "fp8_linear", fails)
    assert "row-wise scaling" in fp8_gemm._probe(fp8_gemm.Fp8Path("rowwise", "t"), cpu, torch.bfloat16)


def test_cpu_path_dequantizes_once_and_says_so():
    path = fp8_gemm.path_for(torch.device("cpu"), torch.float32)
    assert not path.scaled_mm and path.keep_dense
    assert "dequantized to float32 once at load" in path.describe(torch.float32)


def test_fused_parts_and_experts_keep_their_rows_and_scales():
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(n, 32, generator=g) * s for n, s in ((16, 1.0), (8, 30.0), (8, 0.01))]
    fused = cat_out([Fp8Weight.quantize(p) for p in parts])             # Q | K | V
    alone = Fp8Weight.quantize(torch.cat(parts))
    assert torch.equal(fused.q.float(), alone.q.float()) and torch.equal(fused.scale, alone.scale)
    experts = stack([Fp8Weight.quantize(p[:8]) for p in parts])          # [E, N, K]
    assert experts.shape == (3, 8, 32) and experts.scale.shape == (3, 8)
    experts.keep_dense(torch.float32)
    assert torch.equal(experts[1].dequantize(torch.float32), Fp8Weight.quantize(parts[1][:8]).dequantize(torch.float32))
    assert experts[1].dense is not None                                  # the expert's part of the kept copy
    # a checkpoint that left one part unquantized: the parts meet in its dtype
    mixed = cat_out([Fp8Weight.quantize(parts[0]), parts[1]])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (24, 32)


def test_moe_experts_in_fp8_equal_the_float_experts_of_their_values():
    from fastdecode.model.moe import MoESpec, SparseMoE
    g = torch.Generator().manual_seed(5)
    E, h, inter = 4, 32, 16
    router = torch.randn(E, h, generator=g)
    gate_up, down = torch.randn(E, 2 * inter, h, generator=g), torch.randn(E, h, inter, generator=g)
    sgu, sd = torch.randn(2 * 24, h, generator=g), torch.randn(h, 24, generator=g)
    q = [Fp8Weight.quantize(t) for t in (gate_up, down, sgu, sd)]
    spec = MoESpec(E, 2, True)
    fp8 = SparseMoE(spec, router, *q[:2], q[2], q[3])
    plain = SparseMoE(spec, router, *(w.dequantize(torch.float32) for w in q))
    x = torch.randn(11, h, generator=g)
    with fp8_gemm.forced_path("dequant"):
        assert torch.equal(fp8(x), plain(x))


@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with fp8 (compute capability 8.9+)")
def test_scaled_mm_on_the_card():
    dev = torch.device("cuda")
    path = fp8_gemm.path_for(dev, torch.bfloat16)
    assert path.scaled_mm, path.why
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1000, 4096, generator=g).to(dev, torch.bfloat16)
    fw = Fp8Weight.quantize(torch.randn(3072, 4096, generator=g).to(dev))
    y = linear(x, fw)
    ref = quantized_input_reference(x.float(), fw.to(dev)).to(dev)
    assert y.dtype == torch.bfloat16
    assert float((y.double() - ref).norm() / ref.norm()) < 0.01            # bf16 output rounding: 2^-9
    for dtype in (torch.float16, torch.float32):                            # other activation dtypes
        yd = linear(x.to(dtype), fw)
        assert yd.dtype == dtype and float((yd.double() - ref).norm() / ref.norm()) < 0.01
