"""The S-part under its first name: LlamaSPart is SPart (spart.py), which serves every family
ModelConfig admits, the Llama family included."""
from __future__ import annotations

from fastdecode.model.spart import SPart

LlamaSPart = SPart

__all__ = ["LlamaSPart", "SPart"]
