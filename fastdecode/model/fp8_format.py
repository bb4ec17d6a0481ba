"""fp8 weights as numbers: float8_e4m3fn values with one float32 scale per output channel.

A projection's weight W [out, in] is stored as q = round(W / s) in e4m3 with s[r] = max|W[r, :]| /
448 (448 is e4m3's largest finite value, so each row's largest weight lands on it), rounded to
nearest even and saturated at +-448. W is recovered as q * s. Rows are independent, so fused
projections (Q|K|V, gate|up) are the concatenation of their parts' rows and scales, exactly.
How such a weight multiplies (fp8 GEMMs or dequantized) is fp8_gemm.py's; fp8.py is the S-part's
one entry, `linear`.

Shapes: n = rows (tokens), K = in features, N = out features; a stacked weight (MoE experts)
carries leading dims [E, N, K] with scales [E, N].
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0                  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-12                  # an all-zero row gets a tiny scale, not a division by zero


def quantize_rows(w: torch.Tensor, amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., R, C] float -> (q [..., R, C] e4m3, scale [..., R] float32), q * scale ~ w.

    Each row r gets scale max|w[r]| / 448 (its largest element maps to 448); `amax_ub` caps that
    maximum (fbgemm's activation upper bound), values past it saturate at +-448."""
    amax = torch.linalg.vector_norm(w, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # [..., R, 1]
    if amax_ub is not None:
        amax = amax.clamp(max=amax_ub)
    scale = amax.clamp(min=MIN_AMAX) / E4M3_MAX                                                        # [..., R, 1]
    q = (w.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)        # the cast rounds to nearest even
    return q, scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: [..., R, C] e4m3, scale: [..., R] float32 -> q * scale [..., R, C] in `dtype`.

    In `dtype` throughout (one temporary the weight's size): e4m3 values are exact in bf16, fp16
    and fp32; in bf16 the scale and the product round once each (2^-9 relative, against e4m3's
    own 2^-4)."""
    return q.to(dtype).mul_(scale.to(dtype).unsqueeze(-1))


class Fp8Weight:
    """A linear weight [..., N, K] in e4m3 with its float32 scales [..., N].

    act_amax_ub: a checkpoint's cap on each token's max |activation| (fbgemm_fp8's
    activation_scale_ub); None: none."""

    __slots__ = ("act_amax_ub", "dense", "q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, act_amax_ub: float | None = None):
        if q.dtype != E4M3:
            raise ValueError(f"Fp8Weight holds float8_e4m3fn, got {q.dtype}")
        if tuple(scale.shape) != tuple(q.shape[:-1]):
            raise ValueError(f"scale {tuple(scale.shape)} does not match weight {tuple(q.shape)}: expected "
                             f"{tuple(q.shape[:-1])}, one per output row")
        self.q, self.scale, self.act_amax_ub = q, scale.float(), act_amax_ub
        self.dense: torch.Tensor | None = None    # q * scale kept in the compute dtype (keep_dense)

    @classmethod
    def quantize(cls, w: torch.Tensor, rows_per_pass: int = 4096) -> Fp8Weight:
        """From a float weight [..., N, K]: per-output-channel scales. Rows go `rows_per_pass` at
        a time, so the float32 temporaries stay small beside a 70B layer's gate/up."""
        flat = w.reshape(-1, w.shape[-1])                                   # [rows, K]
        q = torch.empty(flat.shape, dtype=E4M3, device=w.device)
        scale = torch.empty(flat.shape[0], dtype=torch.float32, device=w.device)
        for r in range(0, flat.shape[0], rows_per_pass):
            q[r:r + rows_per_pass], scale[r:r + rows_per_pass] = quantize_rows(flat[r:r + rows_per_pass])
        return cls(q.reshape(w.shape), scale.reshape(w.shape[:-1]))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def dtype(self) -> torch.dtype:
        return E4M3

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def to(self, device=None, dtype=None) -> Fp8Weight:
        """On `device`; `dtype` (the activations') changes nothing: the weight stays e4m3."""
        return Fp8Weight(self.q.to(device), self.scale.to(device), self.act_amax_ub)

    def contiguous(self) -> Fp8Weight:
        return Fp8Weight(self.q.contiguous(), self.scale.contiguous(), self.act_amax_ub)

    def __getitem__(self, index) -> Fp8Weight:
        """One expert of a stacked weight: [E, N, K][e] -> [N, K] (its part of `dense` too)."""
        part = Fp8Weight(self.q[index], self.scale[index], self.act_amax_ub)
        part.dense = self.dense[index] if self.dense is not None else None
        return part

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """q * scale in `dtype`: the kept copy where there is one in that dtype."""
        if self.dense is not None and self.dense.dtype == dtype:
            return self.dense
        return dequantize(self.q, self.scale, dtype)

    def keep_dense(self, dtype: torch.dtype) -> None:
        """Dequantize once and keep it (the CPU's dequantize path)."""
        self.dense = dequantize(self.q, self.scale, dtype)

    def __repr__(self) -> str:
        return f"Fp8Weight({tuple(self.q.shape)}, device={self.q.device})"


Weight = torch.Tensor | Fp8Weight


def _common(ws: list[Weight]) -> list[Weight]:
    """Parts of one fused weight in one representation: where a checkpoint mixes fp8 and float
    parts (a part it left unquantized), the fp8 ones are dequantized to the float parts' dtype."""
    if all(isinstance(w, Fp8Weight) for w in ws) or not any(isinstance(w, Fp8Weight) for w in ws):
        return ws
    dtype = next(w.dtype for w in ws if not isinstance(w, Fp8Weight))
    return [w.dequantize(dtype) if isinstance(w, Fp8Weight) else w for w in ws]


def cat_out(ws: list[Weight]) -> Weight:
    """Weights [..., N_i, K] -> one [..., sum N_i, K]: fused projections (rows and scales in order)."""
    ws = _common(ws)
    if isinstance(ws[0], Fp8Weight):
        return Fp8Weight(torch.cat([w.q for w in ws], dim=-2), torch.cat([w.scale for w in ws], dim=-1),
                         ws[0].act_amax_ub)
    return torch.cat(ws, dim=-2)


def stack(ws: list[Weight]) -> Weight:
    """Weights [N, K] -> [E, N, K] (experts)."""
    ws = _common(ws)
    if isinstance(ws[0], Fp8Weight):
        return Fp8Weight(torch.stack([w.q for w in ws]), torch.stack([w.scale for w in ws]), ws[0].act_amax_ub)
    return torch.stack(ws)


def weight_bytes(w) -> int:
    """Bytes a weight holds (an Fp8Weight: its e4m3 values and float32 scales)."""
    return w.nbytes if isinstance(w, Fp8Weight) else w.numel() * w.element_size()
