"""Request fingerprints: what binds an output row to the input line it answers.

A line's digest hashes its JSON canonicalized (keys sorted, no spaces), so reformatting a line
keeps its rows while any change to what it asks (prompt, parameters, url, custom_id) gives a new
digest. A line that is not JSON is hashed as its bytes. A line's key adds the model the job serves
(the `model` its rows name) and how the line is answered: a line with its own custom_id is keyed by
its content alone (it may move within the file); a line without a custom_id, or repeating an
earlier line's, is answered by an error row that names its line numbers, so its key names them too.
"""
from __future__ import annotations

import hashlib
import json

DIGEST_BYTES = 16
PRIMARY, DUPLICATE, NO_ID = 0, 1, 2


def raw_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data.strip(), digest_size=DIGEST_BYTES).digest()


def line_digest(obj, data: bytes) -> bytes:
    """The digest of a parsed line `obj` (read from `data`): of its canonical JSON, or of its bytes
    where it has none (numbers beyond JSON's range, nesting deeper than the encoder takes)."""
    try:
        canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return raw_digest(data)
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES).digest()


def line_key(model: str, kind: int, digest: bytes, line_no: int, first_line: int | None = None) -> bytes:
    """The key a row answering this line is recorded under (16 bytes)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(model.encode("utf-8", "surrogatepass") + b"\0" + bytes([kind]) + digest)
    if kind != PRIMARY:
        h.update(f"\0{line_no}\0{first_line or 0}".encode())
    return h.digest()


def row_digest(row: bytes) -> bytes:
    """A row's bytes (with its newline) as recorded beside the output."""
    return hashlib.blake2b(row, digest_size=DIGEST_BYTES).digest()
