"""A sequence's state, as the scheduler moves it (engine/sequence.py's Sequence carries it)."""
from __future__ import annotations

import enum


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    PREFILLING = 3       # placed, its prompt prefilled in chunks (--max-num-batched-tokens); not decoding yet
