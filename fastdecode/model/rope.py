"""RoPE tables: cos/sin by absolute position, one table per distinct RoPE among the layers
(Gemma 3: its sliding layers' local RoPE and its global layers'; every other family: one).

Frequencies follow HF transformers: the default RoPE computed here, the scaled kinds (linear,
llama3, yarn, longrope) through its ROPE_INIT_FUNCTIONS, whose attention factor multiplies cos
and sin as HF's rotary embeddings do. longrope switches between short and long factors by
sequence length in HF; a job fixes one set for its whole context: the short factors where
the job's context (max_model_len) fits original_max_position_embeddings, else the long ones,
as HF picks for sequences of that length.
"""
from __future__ import annotations

import torch

from fastdecode.model.config import ModelConfig

_LOCAL = "sliding_attention"


class RopeKind:
    """One RoPE: inv_freq [R/2] float32 and its cos/sin tables [L, R] (R: rotary dims)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, length: int, device):
        self.inv_freq, self.scaling = inv_freq, scaling
        self._cos = self._sin = None
        self._extend(length, device)

    def _extend(self, length: int, device):
        pos = torch.arange(length, device=device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]          # [L, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)                # [L, R]
        self._cos = emb.cos() * self.scaling
        self._sin = emb.sin() * self.scaling

    def cos_sin(self, positions: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [n] int64 -> cos, sin [n, 1, R] float32
        if need > self._cos.shape[0]:
            self._extend(max(need, 2 * self._cos.shape[0]), positions.device)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]


class RopeTable:
    """cos/sin of one call's positions for each RoPE kind: `layer(i)` -> (cos, sin) [n, 1, R]
    float32 of layer i's kind."""

    __slots__ = ("tables", "kind_of")

    def __init__(self, tables: list[tuple[torch.Tensor, torch.Tensor]], kind_of: tuple[int, ...]):
        self.tables, self.kind_of = tables, kind_of

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[self.kind_of[i]]


class Rope:
    """The model's RoPE kinds and which layer uses which."""

    def __init__(self, config: ModelConfig, device, context: int | None = None,
                 rope_freqs: torch.Tensor | None = None):
        c = config
        context = context or c.max_context
        length = min(c.max_position, 4096)
        inv_freq, scaling = _inv_freq(c, c.rope_type, c.rope_theta, device, context,
                                      "full_attention" if c.local_rope else None)
        if rope_freqs is not None:           # GGUF llama3: per-frequency factors stored as a tensor
            inv_freq = inv_freq / rope_freqs.to(device=device, dtype=torch.float)
        self.kinds = [RopeKind(inv_freq, scaling, length, device)]
        kind_of = [0] * c.num_layers
        if c.local_rope and _LOCAL in c.layer_types:
            local = c.local_rope
            self.kinds.append(RopeKind(*_inv_freq(c, local["rope_type"], float(local["rope_theta"]), device,
                                                  context, _LOCAL), length, device))
            kind_of = [1 if t == _LOCAL else 0 for t in c.layer_types]
        self.kind_of = tuple(kind_of)
        self.max_position = c.max_position

    @property
    def inv_freq(self) -> torch.Tensor:
        """The global RoPE's inverse frequencies [R/2] float32."""
        return self.kinds[0].inv_freq

    def cos_sin(self, positions: torch.Tensor, max_position: int | None = None) -> RopeTable:
        """positions [n] int64 -> the RopeTable of those positions (max_position from the host
        saves a device sync)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else -1
        return RopeTable([k.cos_sin(positions, max_position + 1) for k in self.kinds], self.kind_of)


def _inv_freq(c: ModelConfig, rope_type: str, theta: float, device, context: int,
              layer_type: str | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2] float32, attention scaling) of one RoPE kind."""
    dim = c.rotary_dim
    if rope_type == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        return 1.0 / (theta ** exponents), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = {k: v for k, v in c.hf_config.items() if not k.startswith("gguf_")}
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        kwargs["seq_len"] = context          # > original_max_position_embeddings: the long factors
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.for_model(**hf), device, **kwargs)
    return inv_freq.to(device=device, dtype=torch.float), float(scaling)
