"""OUTPUT.inflight.kv: the KV-cache of the sequences a stop saved in flight, so that the rerun
reloads it instead of recomputing it (`--save-kv-on-stop`).

It sits beside OUTPUT.inflight (inflight.py) and is bound to it: the file names the SHA-256 that
heads the .inflight it was written with, and a rerun whose .inflight has another ignores it. Per
sequence it holds where the sequence belongs (its line's key, the prompt's place in the line, the
sample index), the tokens its KV covers (the prompt and every output token but the newest, as
`Sequence.kv_len`), the layout its bytes are in (the worker's store: rworker/kvstore.py
`layout_signature`), and the bytes' offset, length and SHA-256.

The file is MAGIC, the index's length (8 bytes, little-endian), the index (JSON), then the bytes of
every sequence; written to a temporary file beside it and renamed over the old one, as the
.inflight is. The rerun maps it (nothing is read before a sequence needs it), checks a sequence's
SHA-256 when it sends its bytes to a worker, and recomputes a sequence whose bytes are damaged, in
another layout than its new worker's, or for other tokens than the saved ones (named on stderr).
The worker's store checks the bytes' geometry and size again before it takes them.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
from dataclasses import dataclass

from fastdecode.batch.filemode import open_no_link, replace_atomically
from fastdecode.batch.inflight_read import Untrusted

MAGIC = b"fastdecode in-flight KV v1\n"
FORMAT = "fastdecode in-flight KV"
INDEX_MAX = 256 << 20          # bytes of the JSON index a file may claim (millions of sequences)
MODES = ("auto", "never", "always")
AUTO_SHARE = 0.5               # auto saves where the KV takes at most this share of the free space


def kv_path(inflight_path: str) -> str:
    return inflight_path + ".kv"


def inflight_digest(path: str, magic: bytes) -> str | None:
    """The SHA-256 (hex) heading the .inflight at `path` (inflight.py's layout), None if none."""
    try:
        with open(path, "rb") as f:
            if f.read(len(magic)) != magic:
                return None
            digest = f.read(32)
    except OSError:
        return None
    return digest.hex() if len(digest) == 32 else None


@dataclass(slots=True)
class Item:
    """One sequence's KV as a stop exports it."""
    key: bytes            # the line's key
    prompt: int           # the prompt's place in the line
    sample: int           # the sample index
    tokens: int           # KV tokens it covers
    layout: bytes         # the store layout its bytes are in
    blob: bytes           # the store's export


# ---------------------------------------------------------------------------- writing

def save(path: str, like: str, bound_to: str, items: list[Item]) -> int:
    """Write `items` to `path` atomically with the mode of `like`, bound to the .inflight whose
    digest is `bound_to`; none: remove the file. -> bytes written."""
    if not items:
        discard(path)
        return 0
    entries, offset = [], 0
    for it in items:
        entries.append({"key": it.key.hex(), "prompt": it.prompt, "sample": it.sample, "tokens": it.tokens,
                        "layout": it.layout.hex(), "offset": offset, "length": len(it.blob),
                        "sha256": hashlib.sha256(it.blob).hexdigest()})
        offset += len(it.blob)
    index = json.dumps({"format": FORMAT, "inflight_sha256": bound_to, "sequences": entries}).encode()
    replace_atomically(path, like, [MAGIC + struct.pack("<Q", len(index)) + index] + [it.blob for it in items])
    return len(MAGIC) + 8 + len(index) + offset


def discard(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def room_for(path: str, nbytes: int, mode: str) -> str | None:
    """Why `nbytes` of KV should not be saved beside `path` under `mode`, None if they should:
    never saves nothing, auto at most AUTO_SHARE of the free space, always whatever fits."""
    if mode == "never":
        return "--save-kv-on-stop never"
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
    except OSError as e:
        return f"the output's directory: {e}"
    free = st.f_bavail * st.f_frsize
    limit = free * (AUTO_SHARE if mode == "auto" else 1.0)
    if nbytes > limit:
        return (f"{nbytes / 2**30:.2f} GiB of KV, {free / 2**30:.2f} GiB free beside the output"
                + (" (auto saves up to half of it; --save-kv-on-stop always takes more)" if mode == "auto" else ""))
    return None


# ---------------------------------------------------------------------------- reading

class Record:
    """One saved sequence's KV in the mapped file: its bytes are checked when taken."""
    __slots__ = ("tokens", "layout", "_view", "_sha")

    def __init__(self, tokens: int, layout: bytes, view: memoryview, sha: str):
        self.tokens, self.layout, self._view, self._sha = tokens, layout, view, sha

    def refusal(self, kv_tokens: int, layout: bytes | None) -> str | None:
        """Why these bytes cannot be the KV of a sequence of `kv_tokens` on a worker of `layout`."""
        if layout is None:
            return "its worker keeps no KV it can import (the S-worker's own tier)"
        if layout != self.layout:
            return "its worker's KV layout differs from the saved one's"
        if kv_tokens != self.tokens:
            return f"the saved KV covers {self.tokens} tokens, the sequence {kv_tokens}"
        return None

    def __reduce__(self):
        """Pickled with a copy of its bytes (the dealer hands a line's saved KV to another group)."""
        return Record, (self.tokens, self.layout, bytes(self._view), self._sha)

    def blob(self) -> memoryview:
        """The bytes, checked against their SHA-256 (Untrusted if damaged)."""
        if hashlib.sha256(self._view).hexdigest() != self._sha:
            raise Untrusted("its KV's checksum does not match: the file is damaged")
        return self._view


class SavedKV:
    """The KV file a rerun starts from, mapped: records by (line key, prompt, sample)."""

    def __init__(self, path: str, bound_to: str | None):
        self.path = path
        self.records: dict[tuple[bytes, int, int], Record] = {}
        self._map = None
        if not os.path.exists(path):
            return
        try:
            self._open(bound_to)
        except (OSError, Untrusted, ValueError) as e:
            self.records = {}
            print(f"fastdecode: {path}: ignored, not trusted ({str(e)[:300]}); its sequences are recomputed",
                  file=sys.stderr, flush=True)

    def _open(self, bound_to: str | None) -> None:
        fd = open_no_link(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < len(MAGIC) + 8:
                raise Untrusted("too short for a KV save")
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        m = memoryview(self._map)
        if bytes(m[:len(MAGIC)]) != MAGIC:
            raise Untrusted("not an in-flight KV save of fastdecode")
        (n,) = struct.unpack("<Q", m[len(MAGIC):len(MAGIC) + 8])
        start = len(MAGIC) + 8
        if n > min(INDEX_MAX, size - start):
            raise Untrusted(f"its index claims {n} bytes, more than the file holds")
        index = json.loads(bytes(m[start:start + n]))
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise Untrusted("not an in-flight KV save of fastdecode")
        if bound_to is None or index.get("inflight_sha256") != bound_to:
            raise Untrusted("it was saved with another OUTPUT.inflight than the one beside it")
        self.records = _records(index.get("sequences"), m[start + n:])

    def take(self, key: bytes, prompt: int, sample: int) -> Record | None:
        return self.records.pop((key, prompt, sample), None)


def _records(entries, data: memoryview) -> dict[tuple[bytes, int, int], Record]:
    """The index's entries, each field checked, their bytes within `data`."""
    if not isinstance(entries, list):
        raise Untrusted("its index lists no sequences")
    out = {}
    for e in entries:
        if not isinstance(e, dict):
            raise Untrusted("an index entry is not an object")
        ints = [e.get(k) for k in ("prompt", "sample", "tokens", "offset", "length")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise Untrusted("an index entry's counts are not non-negative integers")
        prompt, sample, tokens, offset, length = ints
        try:
            key, layout = bytes.fromhex(e.get("key")), bytes.fromhex(e.get("layout"))
            sha = e.get("sha256")
            if not isinstance(sha, str) or len(bytes.fromhex(sha)) != 32:
                raise ValueError
        except (TypeError, ValueError):
            raise Untrusted("an index entry's key, layout or checksum is not hex") from None
        if offset + length > len(data):
            raise Untrusted("an index entry's bytes lie past the end of the file")
        out[(key, prompt, sample)] = Record(tokens, layout, data[offset:offset + length], sha)
    return out
