"""The attention variants a model asks of the R-part: softmax scale, per-layer sliding windows,
logit soft-capping and learned sink logits. The S-worker derives them from the model's config
(and its weights, for sinks) once; every R-worker builds its store with them (HELLO carries them
over MPI), and the local backend builds its own the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdecode.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class AttentionVariants:
    scale: float                        # softmax scale of q . k
    windows: tuple[int, ...] = ()       # [L] keys each layer's query attends, its own included (0: all)
    softcap: float = 0.0                # cap * tanh(s / cap) on every score (0: none)
    sinks: tuple[float, ...] = ()       # [L * Hq] learned sink logits, layer-major (): none

    @classmethod
    def of(cls, config: ModelConfig, model=None) -> "AttentionVariants":
        """The variants of `config`; sinks come from the S-part's weights (model.sinks(layer))."""
        scale = config.attn_scale or config.head_dim ** -0.5
        windows = tuple(int(w) for w in config.layer_windows)
        sinks: tuple[float, ...] = ()
        if config.attn_sinks and model is not None:
            rows = [model.sinks(layer) for layer in range(config.num_layers)]
            missing = [layer for layer, r in enumerate(rows) if r is None]
            if missing and len(missing) < len(rows):
                raise ValueError(f"the model has attention sinks on some layers but none on layer {missing[0]}")
            if not missing:
                sinks = tuple(float(x) for r in rows for x in r.detach().float().cpu().numpy().ravel())
        return cls(float(scale), windows if any(windows) else (), float(config.attn_softcap or 0),
                   sinks)

    @property
    def windowed(self) -> bool:
        return any(self.windows)

    def sink_rows(self, num_layers: int, num_heads: int) -> np.ndarray | None:
        """sinks as [L, Hq] float32, or None."""
        if not self.sinks:
            return None
        return np.asarray(self.sinks, dtype=np.float32).reshape(num_layers, num_heads)

    def store_kwargs(self, num_layers: int, num_heads: int) -> dict:
        """open_tuned_store's keyword arguments for these variants."""
        return {"scale": self.scale, "windows": self.windows or None, "softcap": self.softcap or None,
                "sinks": self.sink_rows(num_layers, num_heads)}
