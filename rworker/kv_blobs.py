"""A store's sequences as blobs, seen from whoever holds the store (an R-worker, or local mode's
in-process store): its layout signature for the roster and one blob in. No MPI here (local mode
never loads it); the wire side is rworker.kv_transfer."""
from __future__ import annotations


def layout_hex(store) -> str:
    """The store's layout signature as hex for the roster ("": a store that cannot move KV)."""
    signature = getattr(store, "layout_signature", None)
    return signature().hex() if signature is not None else ""


def import_one(store, seq_id: int, blob, held: set[int] | None = None) -> tuple[bool, str]:
    """One blob into the store -> (stored, why it was refused or ""). Not stored and no reason:
    its pages would pass the store's capacity. `held`: the ids the caller tracks as held (an
    R-worker's `known`), checked first and extended by a stored sequence."""
    if held is not None and seq_id in held:
        return False, f"sequence {seq_id} is already held here"
    try:
        stored = bool(store.import_seq(seq_id, blob))
    except ValueError as e:
        return False, str(e) or type(e).__name__
    if stored and held is not None:
        held.add(seq_id)
    return stored, ""
