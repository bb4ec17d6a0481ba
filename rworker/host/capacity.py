"""How much host memory an R-worker may fill with KV-cache."""
from __future__ import annotations

import psutil

RESERVE_FRACTION = 0.10      # leave room for the OS, MPI buffers and the S-worker if it shares the node
RESERVE_MIN_BYTES = 1 << 30


def default_capacity_bytes(share: int = 1, taken: int = 0) -> int:
    """Available memory less a reserve and what the S-worker's own KV tier `taken` on this node,
    split among `share` KV holders on this node."""
    vm = psutil.virtual_memory()
    reserve = max(int(vm.total * RESERVE_FRACTION), RESERVE_MIN_BYTES)
    return max(vm.available - reserve - taken, 0) // max(share, 1)


def parse_bytes(text: str) -> int:
    """'64G', '512M', '1.5T', '1000000' -> bytes (binary units); a size must be positive."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        value = float(s[:-1]) * units[s[-1]] if s and s[-1] in units else float(s)
    except ValueError:
        raise ValueError(f"cannot read a memory size from {text!r} (examples: 64G, 512M)") from None
    if not value >= 1 or value == float("inf"):
        raise ValueError(f"a memory size must be at least 1 byte, got {text!r}")
    return int(value)
