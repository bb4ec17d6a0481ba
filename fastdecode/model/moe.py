"""The sparse mixture-of-experts MLP of one layer (mixtral, qwen2_moe, qwen3_moe).

Routing rounds where HF transformers' blocks round: router logits in the activation dtype,
softmax in float32, top-k, optional renormalisation, then the weights either cast to the
activation dtype (qwen) or kept in float32 until after the scale (mixtral). The experts run as
grouped GEMMs over the batch's routed rows: the n*k (row, expert) assignments are sorted by
expert, the rows gathered once, each expert's slice multiplied by its own weights (one
`grouped_mm` call on a CUDA bf16 S-worker, else one GEMM per busy expert), and the scaled
results scatter-added back into their rows. fp8 experts (fp8.py: stacked e4m3 weights with
per-row scales) run one fp8 GEMM per busy expert; the router stays in the activation dtype.

Shapes: n = rows, h = hidden, E = experts, k = top-k, I = expert intermediate,
Is = shared expert intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdecode.model.fp8 import Fp8Weight, cat_out, linear, stack

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    norm_topk_prob: bool          # renormalise the top-k weights to sum 1 (mixtral: always True)
    act: str = "silu"             # SwiGLU activation
    # mixtral keeps the routing weights in float32 and rounds after scaling; qwen2/3_moe cast them
    # to the activation dtype first. The same in float32, one bf16 rounding apart otherwise.
    fp32_routing_weights: bool = False


def _grouped_mm_fn():
    # the public name in newer torch, the private one before; None where neither exists
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_supported(x: torch.Tensor, gate_up) -> bool:
    """CUDA bf16 on sm80+, with the 16-byte row alignment the kernel needs for both GEMMs (not fp8 experts)."""
    if isinstance(gate_up, Fp8Weight):
        return False
    if _grouped_mm_fn() is None or x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    if gate_up.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    two_i, h = gate_up.shape[1:]
    return h % 8 == 0 and (two_i // 2) % 8 == 0


class SparseMoE:
    """One layer's routed experts (and qwen2_moe's gated shared expert) on one device.

    Weights are used as given: the caller puts them on the device and in the activation dtype
    (the experts and the shared expert may be Fp8Weight). `use_grouped_mm`: None picks
    `grouped_mm` where supported; True/False forces a path.
    """

    def __init__(self, spec: MoESpec, router: torch.Tensor, gate_up, down,
                 shared_gate_up=None, shared_down=None, shared_gate: torch.Tensor | None = None):
        if spec.act not in _ACTS:
            raise ValueError(f"MoE activation {spec.act!r} not supported (have {sorted(_ACTS)})")
        E, h = router.shape
        if E != spec.num_experts or not 0 < spec.top_k <= E:
            raise ValueError(f"router has {E} experts, spec says {spec.num_experts} with top-{spec.top_k}")
        if gate_up.shape[0] != E or gate_up.shape[2] != h or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up {tuple(gate_up.shape)} is not [E={E}, 2I, h={h}]")
        if tuple(down.shape) != (E, h, gate_up.shape[1] // 2):
            raise ValueError(f"down {tuple(down.shape)} is not [E={E}, h={h}, I={gate_up.shape[1] // 2}]")
        if (shared_gate_up is None) != (shared_down is None):
            raise ValueError("shared expert needs both shared_gate_up and shared_down")
        self.spec = spec
        self.act = _ACTS[spec.act]
        self.router = router                      # [E, h]
        self.gate_up = gate_up                    # [E, 2I, h] gate rows first, then up
        self.down = down                          # [E, h, I]
        self.shared_gate_up = shared_gate_up      # [2Is, h] or None
        self.shared_down = shared_down            # [h, Is] or None
        self.shared_gate = shared_gate            # [1, h] or None
        self.use_grouped_mm: bool | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, h] -> (weights [n, k], experts [n, k] int64), rounded as HF transformers does."""
        logits = F.linear(x, self.router)                                   # [n, E] x.dtype
        probs = torch.softmax(logits.float(), dim=-1)                       # [n, E] float32
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)       # [n, k]
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.spec.fp32_routing_weights:
            weights = weights.to(logits.dtype)
        return weights, experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, h] post-norm hidden -> [n, h]
        n, k, E = x.shape[0], self.spec.top_k, self.spec.num_experts
        if n == 0:
            return x.new_zeros(x.shape)
        weights, experts = self.route(x)                                    # [n, k], [n, k]
        flat = experts.reshape(-1)                                          # [n*k] expert per assignment
        order = torch.argsort(flat, stable=True)                            # [n*k] grouped by expert
        rows = order // k                                                   # [n*k] source row of each
        counts = torch.bincount(flat, minlength=E)                          # [E] rows per expert
        xs = x.index_select(0, rows)                                        # [n*k, h]
        ys = self._experts(xs, counts)                                      # [n*k, h] x.dtype
        # scale in the routing weights' dtype (float32 for mixtral), round to x.dtype, then add
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, rows, ys)                   # [n, h]
        if self.shared_gate_up is not None:
            out = out + self._shared(x)
        return out

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs: [m, h] rows sorted by expert, counts: [E] -> SwiGLU expert outputs [m, h]."""
        use = self.use_grouped_mm
        if use is None:
            use = _grouped_mm_supported(xs, self.gate_up)
        if use:
            try:
                return self._experts_grouped(xs, counts)
            except RuntimeError:
                if self.use_grouped_mm:      # forced: the caller wants to see the failure
                    raise
                self.use_grouped_mm = False  # a kernel this build lacks: loop from now on
        return self._experts_loop(xs, counts)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        # gu: [m, 2I] -> [m, I]
        gate, up = gu.chunk(2, dim=-1)
        return self.act(gate) * up

    def _experts_grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # one kernel per GEMM over every expert's slice; no host sync on the counts
        mm = _grouped_mm_fn()
        offs = torch.cumsum(counts, 0).to(torch.int32)                      # [E] end row of each
        gu = mm(xs, self.gate_up.transpose(1, 2), offs=offs)               # [m, 2I]
        return mm(self._swiglu(gu), self.down.transpose(1, 2), offs=offs)  # [m, h]

    def _experts_loop(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # one GEMM per expert with rows; the activation runs once over all rows in between
        m, two_i = xs.shape[0], self.gate_up.shape[1]
        bounds = [0] + torch.cumsum(counts, 0).tolist()                     # one host sync
        busy = [(e, bounds[e], bounds[e + 1]) for e in range(len(counts)) if bounds[e + 1] > bounds[e]]
        gu = xs.new_empty((m, two_i))                                       # [m, 2I]
        fp8 = isinstance(self.gate_up, Fp8Weight)
        for e, s, t in busy:
            if fp8:
                gu[s:t] = linear(xs[s:t], self.gate_up[e])
            else:
                torch.matmul(xs[s:t], self.gate_up[e].t(), out=gu[s:t])
        act = self._swiglu(gu)                                              # [m, I]
        ys = xs.new_empty(xs.shape)                                         # [m, h]
        for e, s, t in busy:
            if fp8:
                ys[s:t] = linear(act[s:t], self.down[e])
            else:
                torch.matmul(act[s:t], self.down[e].t(), out=ys[s:t])
        return ys

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        # qwen2_moe's always-on expert, scaled by sigmoid(x . shared_gate): [n, h] -> [n, h]
        y = linear(self._swiglu(linear(x, self.shared_gate_up)), self.shared_down)
        if self.shared_gate is not None:
            y = torch.sigmoid(F.linear(x, self.shared_gate)) * y            # [n, 1] * [n, h]
        return y


# ----------------------------------------------------------------------------- checkpoint layouts

# per-expert names of published checkpoints: (gate, up, down)
_PER_EXPERT = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}
# HF transformers loads mixtral's block_sparse_moe.* as mlp.*, and writes that name when it saves
# without converting back to the original layout
_PREFIX_ALIASES = (("block_sparse_moe.", "mlp."), ("mlp.", "block_sparse_moe."))


def _resolve_prefix(weights: dict, prefix: str) -> str:
    if prefix + "gate.weight" in weights:
        return prefix
    for old, new in _PREFIX_ALIASES:
        if prefix.endswith(old) and prefix[:-len(old)] + new + "gate.weight" in weights:
            return prefix[:-len(old)] + new
    raise KeyError(f"MoE weights: missing the router {prefix}gate.weight")


def _take(weights: dict, key: str, used: list[str], what: str = "") -> torch.Tensor:
    if key not in weights:
        raise KeyError(f"MoE weights: missing {key}{what}")
    used.append(key)
    return weights[key]


def _stack_per_expert(weights: dict, p: str, num_experts: int, used: list[str]):
    """The published layout: one [I, h] / [h, I] tensor per expert and projection."""
    names = _PER_EXPERT["mixtral" if any(k.startswith(p + "experts.") and k.endswith(".w1.weight")
                                         for k in weights) else "qwen"]
    parts = [[_take(weights, f"{p}experts.{e}.{name}.weight", used, f" (expert {e} of {num_experts})")
              for e in range(num_experts)] for name in names]
    gate, up, down = (stack(t) for t in parts)                          # [E, I, h], [E, I, h], [E, h, I]
    return cat_out([gate, up]), down                                    # [E, 2I, h], [E, h, I]


def stack_experts(weights: dict[str, torch.Tensor], prefix: str, num_experts: int, *,
                  consumed: set[str] | None = None) -> dict:
    """One layer's MoE tensors under `prefix` -> SparseMoE's keyword arguments.

    Accepts the per-expert layout (mixtral w1/w3/w2, qwen gate_proj/up_proj/down_proj; what HF
    transformers' save_pretrained writes by default) and HF transformers' fused in-memory layout
    (`experts.gate_up_proj` [E, 2I, h], `experts.down_proj` [E, h, I]; save_pretrained with
    save_original_format=False). Mixtral's `block_sparse_moe.` and `mlp.` name the same block.
    The checkpoint keys read are added to `consumed`, so the caller can check for leftovers.
    """
    used: list[str] = []
    p = _resolve_prefix(weights, prefix)
    out = {"router": _take(weights, p + "gate.weight", used)}            # [E, h]
    if out["router"].shape[0] != num_experts:
        raise ValueError(f"MoE weights: {p}gate.weight routes to {out['router'].shape[0]} experts, "
                         f"expected {num_experts}")
    if p + "experts.gate_up_proj" in weights:
        gate_up = _take(weights, p + "experts.gate_up_proj", used)       # [E, 2I, h]
        down = _take(weights, p + "experts.down_proj", used)             # [E, h, I]
        h = out["router"].shape[1]
        if len(gate_up.shape) != 3 or gate_up.shape[0] != num_experts or gate_up.shape[2] != h:
            raise ValueError(f"MoE weights: {p}experts.gate_up_proj is {tuple(gate_up.shape)}, "
                             f"expected [E={num_experts}, 2I, h={h}]")
    else:
        gate_up, down = _stack_per_expert(weights, p, num_experts, used)
    out["gate_up"], out["down"] = gate_up, down
    s = p + "shared_expert."
    if s + "gate_proj.weight" in weights:
        out["shared_gate_up"] = cat_out([_take(weights, s + "gate_proj.weight", used),
                                         _take(weights, s + "up_proj.weight", used)])    # [2Is, h]
        out["shared_down"] = _take(weights, s + "down_proj.weight", used)                # [h, Is]
    if p + "shared_expert_gate.weight" in weights:
        out["shared_gate"] = _take(weights, p + "shared_expert_gate.weight", used)       # [1, h]
    if consumed is not None:
        consumed.update(used)
    return out
