"""How an fp8 weight's GEMM runs on a device: torch._scaled_mm where the card has fp8 GEMMs, else
the weight dequantized to the activation dtype at each use.

On CUDA with compute capability 8.9 or later each call quantizes its activations to e4m3 with one
scale per token (row), then `torch._scaled_mm(x_q, W_q^T)` multiplies on the card's fp8 tensor
cores with the token scales and the weight's output-channel scales applied in the GEMM
("rowwise"). Builds whose rowwise form does not take the activation dtype run the GEMM with unit
scales into float32 and apply both scales after ("tensorwise": bf16's range suffices, fp16's
would overflow, hence float32). Which form a build takes is not documented across torch
releases, so the path is picked by a probe: once per (device, dtype), on a small product against
the float32 result of the same e4m3 operands. A build that passes neither probe, an older GPU or
a CPU takes the dequantize path, and says so.

The activations' quantization is one fused Triton pass on CUDA (triton_ops.quantize_fp8_rows),
itself checked once against the torch code here; the torch code elsewhere. A weight whose shape
the card's fp8 GEMM cannot take (in or out features not a multiple of 16) is dequantized.

Shapes: n = rows (tokens), K = in features, N = out features.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdecode.model.fp8_format import Fp8Weight, quantize_rows

FP8_CAPABILITY = (8, 9)       # Ada and Hopper and later: fp8 tensor cores
ALIGN = 16                    # the fp8 GEMM's K and N must be multiples of it


@dataclass(frozen=True)
class Fp8Path:
    """kind: "rowwise" | "tensorwise" (torch._scaled_mm) | "dequant"; why: a phrase for the
    start-up line; triton_quant: the activations' quantization as one Triton pass; pad_rows: the
    build's GEMM wants the rows in multiples of 16 (padded and cut); keep_dense: the dequantize
    path converts once at load and keeps the result (a CPU: fp8.py says why)."""
    kind: str
    why: str
    triton_quant: bool = False
    pad_rows: bool = False
    keep_dense: bool = False

    @property
    def scaled_mm(self) -> bool:
        return self.kind != "dequant"

    def describe(self, dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        if self.scaled_mm:
            return (f"GEMMs in fp8 (torch._scaled_mm, {self.kind} scales, per-token activation scales"
                    f"{', Triton quantization' if self.triton_quant else ''}), results in {name}")
        when = "once at load and kept" if self.keep_dense else "at each use"
        return f"weights dequantized to {name} {when} ({self.why})"


_paths: dict[tuple, Fp8Path] = {}
_forced: list[Fp8Path] = []


@contextlib.contextmanager
def forced_path(path: str | Fp8Path):
    """Run every fp8 GEMM in the block by `path` (or a kind: "rowwise", "tensorwise", "dequant"),
    whatever the device: tests and benchmarks (torch's CPU _scaled_mm runs the rowwise form in
    float32)."""
    _forced.append(path if isinstance(path, Fp8Path) else Fp8Path(path, "forced"))
    try:
        yield
    finally:
        _forced.pop()


def path_for(device: torch.device, dtype: torch.dtype) -> Fp8Path:
    """The fp8 GEMM path of `device` for activations in `dtype` (probed once; call it before a
    CUDA graph capture)."""
    if _forced:
        return _forced[-1]
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype)
    if key not in _paths:
        _paths[key] = _pick(device, dtype)
    return _paths[key]


def _pick(device: torch.device, dtype: torch.dtype) -> Fp8Path:
    if device.type != "cuda":
        return Fp8Path("dequant", f"no fp8 GEMMs on {device.type}", keep_dense=True)
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_CAPABILITY:
        return Fp8Path("dequant", f"{torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}; fp8 GEMMs need "
                                  f"sm{FP8_CAPABILITY[0]}{FP8_CAPABILITY[1]}+")
    if not hasattr(torch, "_scaled_mm"):
        return Fp8Path("dequant", f"torch {torch.__version__} has no _scaled_mm")
    triton_quant = _triton_quant_works(device)
    failures = []
    for kind in ("rowwise", "tensorwise"):
        for pad in (False, True):
            path = Fp8Path(kind, "probed", triton_quant, pad)
            error = _probe(path, device, dtype)
            if error is None:
                return path
            failures.append(f"{kind}{' padded' if pad else ''}: {error}")
    return Fp8Path("dequant", "torch._scaled_mm failed its probe here: " + "; ".join(failures)[:300])


def _probe(path: Fp8Path, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if `path` multiplies a [17, 64] by a [48, 64] fp8 weight to within 2% of the float32
    product of the same e4m3 operands (the output's own rounding is < 0.4% in bf16), else why not."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(17, 64, generator=g).to(device=device, dtype=dtype)
    w = Fp8Weight.quantize(torch.randn(48, 64, generator=g).to(device))
    try:
        y = fp8_linear(x, w, None, path).float()
        xq, xs = quantize_rows(x)
        ref = (xq.float() * xs[:, None]) @ w.dequantize(torch.float32).t()
        err = float((y - ref).norm() / ref.norm())
    except (RuntimeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None if err < 0.02 else f"relative error {err:.3g}"


def _triton_quant_works(device: torch.device) -> bool:
    """The Triton quantization of a [37, 200] probe equals the torch code's: the same scales, and
    values at most one e4m3 step apart (a division rounded differently) on at most 1% of them."""
    from fastdecode.model.ops import _triton_ops
    tri = _triton_ops()
    if tri is None:
        return False
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(37, 200, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(device=device,
                                                                                    dtype=torch.bfloat16)
    try:
        q, s = tri.quantize_fp8_rows(x)
        q_ref, s_ref = quantize_rows(x)
        a, b = q.float(), q_ref.float()
        close = bool(((a - b).abs() <= b.abs() / 8 + 2.0 ** -9).all())
        return close and float((a != b).float().mean()) <= 0.01 and bool(torch.allclose(s, s_ref, rtol=1e-6))
    except Exception:  # noqa: BLE001 - a kernel this card or build cannot run: the torch code
        return False


def quantize_tokens(x: torch.Tensor, amax_ub: float | None, triton_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n, K] -> (e4m3 [n, K], float32 scales [n, 1]): one scale per token."""
    if triton_quant:
        from fastdecode.model.ops import _triton_ops
        q, s = _triton_ops().quantize_fp8_rows(x.contiguous(), amax_ub)
    else:
        q, s = quantize_rows(x, amax_ub)
    return q, s.unsqueeze(-1)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               path: Fp8Path | None = None) -> torch.Tensor:
    """x: [n, K] in the activation dtype, w: [N, K] -> x @ W^T (+ bias) [n, N] in x's dtype."""
    path = path or path_for(x.device, x.dtype)
    n_out, k = w.q.shape
    if not path.scaled_mm or k % ALIGN or n_out % ALIGN:
        return F.linear(x, w.dequantize(x.dtype), bias)
    n = x.shape[0]
    if n == 0:
        return x.new_zeros(0, n_out)
    xq, xs = quantize_tokens(x, w.act_amax_ub, path.triton_quant)          # [n, K] e4m3, [n, 1]
    if path.pad_rows and n % ALIGN:
        pad = ALIGN - n % ALIGN
        xq = torch.cat([xq, xq.new_zeros(pad, k)])
        xs = torch.cat([xs, xs.new_ones(pad, 1)])
    wt = w.q.t()                                                           # [K, N] column-major
    if path.kind == "rowwise":
        y = torch._scaled_mm(xq, wt, scale_a=xs, scale_b=w.scale.unsqueeze(0), out_dtype=x.dtype)
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)   # made per call: safe inside a graph capture
        y = torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y[0] if isinstance(y, tuple) else y
        y = (y * xs * w.scale).to(x.dtype)                                 # [n, N]
    y = y[0] if isinstance(y, tuple) else y                                # (older torch: (out, amax))
    y = y[:n]
    return y if bias is None else y + bias
