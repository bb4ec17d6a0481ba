"""Reading OUTPUT.inflight as untrusted input (inflight.py writes it).

The checksum finds damage, not forgery: whoever can write beside the output can write a file
whose checksum matches. So every field is checked as an input line's are, before anything of it
reaches the engine: types and ranges (a seed the sampler takes, token ids, sample indices, the
finish and stop reasons the engine gives), token counts that match the arrays, no array the
manifest does not name. The arrays are read without decompression: the job stores them as they
are (np.savez), so a compressed member, members that add up to more than the file, or a .npy
header that promises more than its member holds is refused before anything is allocated. The
checksum is streamed: reading costs at most the file's size in memory.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import zipfile

import numpy as np
from numpy.lib import format as npy

from fastdecode.engine.continuation import FINISH_REASONS, RequestState, SequenceState

SEED_MAX = (1 << 63) - 1          # the seeds the engine gives its requests (llm_engine.request_seed)
ID_MAX = (1 << 31) - 1            # token ids, sample indices, stop token ids
TOP_MAX = 1 << 10                 # top log-probabilities per position (vLLM's max is 20)
DIGEST_HEX = 32                   # a line key, a prompt digest: 16 bytes in hex


class Untrusted(ValueError):
    pass


# ---------------------------------------------------------------------------- the file

def load(path: str, magic: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The manifest (a dict) and the arrays of the save at `path`, checked whole and bounded."""
    with open(path, "rb") as f:
        if f.read(len(magic)) != magic:
            raise Untrusted("not an in-flight save of fastdecode")
        digest = f.read(32)
        h = hashlib.sha256()
        size = 0
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
        if h.digest() != digest:
            raise Untrusted("its checksum does not match: the file is damaged")
        arrays = _stored_arrays(f, size)
    raw = arrays.pop("manifest", None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise Untrusted("it holds no manifest")
    try:
        manifest = json.loads(raw.tobytes())
    except (ValueError, RecursionError) as e:
        raise Untrusted(f"its manifest is not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise Untrusted(f"its manifest is a JSON {type(manifest).__name__}, not an object")
    return manifest, arrays


def _stored_arrays(f, payload_size: int) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(f)
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise Untrusted(f"cannot be read: {e}") from None
    names = [info.filename for info in infos]
    if len(set(names)) != len(names) or not all(n.endswith(".npy") for n in names):
        raise Untrusted("its archive repeats a member or holds one that is not an array")
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise Untrusted(f"its member {info.filename} is compressed: the job stores its arrays as they are")
    if sum(info.file_size for info in infos) > payload_size:
        raise Untrusted("its archive's members add up to more than the file")
    arrays = {}
    for info in infos:
        try:
            with archive.open(info) as member:
                data = member.read(info.file_size + 1)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise Untrusted(f"its member {info.filename} cannot be read: {e}") from None
        if len(data) != info.file_size:
            raise Untrusted(f"its member {info.filename} is cut short")
        arrays[info.filename[:-4]] = _array(data, info.filename)
    return arrays


def _array(data: bytes, name: str) -> np.ndarray:
    """A .npy member as an array over its bytes, its header checked against its length."""
    buf = io.BytesIO(data)
    try:
        version = npy.read_magic(buf)
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, fortran, dtype = read_header(buf)
    except (ValueError, TypeError, SyntaxError) as e:
        raise Untrusted(f"its member {name} is not an array: {e}") from None
    if dtype.hasobject or dtype.kind not in "biuf":
        raise Untrusted(f"its member {name} holds {dtype}, not numbers")
    count = math.prod(shape)
    if count * dtype.itemsize != len(data) - buf.tell():
        raise Untrusted(f"its member {name}'s header promises {count} values of {dtype}, not what it holds")
    return np.frombuffer(data, dtype, count, buf.tell()).reshape(shape, order="F" if fortran else "C")


# ---------------------------------------------------------------------------- the manifest

def _int(value, lo: int, hi: int, what: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise Untrusted(f"{what} {value!r:.40} is not an integer in [{lo}, {hi}]")
    return value


def _of(obj, key: str, kinds: tuple, what: str):
    value = obj.get(key)
    if type(value) not in kinds:
        raise Untrusted(f"{what}'s {key} {value!r:.40} is not {' or '.join(k.__name__ for k in kinds)}")
    return value


def _hex(value, what: str) -> str:
    if type(value) is not str or len(value) != DIGEST_HEX or any(c not in "0123456789abcdef" for c in value):
        raise Untrusted(f"{what} {value!r:.40} is not {DIGEST_HEX} hex digits")
    return value


def _column(arrays: dict, name: str, kind: str, shape: tuple, used: set) -> np.ndarray:
    """arrays[name], of `kind` ("i" integers, "f" floats) and `shape` (None: any length there)."""
    col = arrays.get(name)
    if col is None:
        raise Untrusted(f"its array {name} is missing")
    if col.dtype.kind not in ("iu" if kind == "i" else "f") or col.ndim != len(shape) or \
            any(want is not None and got != want for got, want in zip(col.shape, shape)):
        raise Untrusted(f"its array {name} is {col.dtype} {col.shape}, not {kind} {shape}")
    if kind == "i" and col.size and (col.min() < -ID_MAX or col.max() > ID_MAX):
        raise Untrusted(f"its array {name} holds values out of range")
    used.add(name)
    return col


def _logprobs(arrays: dict, j: int, n: int, used: set) -> list[tuple]:
    chosen = _column(arrays, f"lp{j}_chosen", "f", (n,), used)
    rank = _column(arrays, f"lp{j}_rank", "i", (n,), used)
    ids = _column(arrays, f"lp{j}_ids", "i", (n, None), used)
    top = _column(arrays, f"lp{j}_top", "f", (n, ids.shape[1]), used)
    if ids.shape[1] > TOP_MAX:
        raise Untrusted(f"its array lp{j}_ids has {ids.shape[1]} top log-probabilities a token")
    return [(float(chosen[i]), int(rank[i]), ids[i], top[i]) for i in range(n)]


def _prompt_logprobs(arrays: dict, li: int, r: int, used: set) -> tuple:
    logprob = _column(arrays, f"plp{li}_{r}_0", "f", (None,), used)
    m = logprob.shape[0]
    ids = _column(arrays, f"plp{li}_{r}_2", "i", (m, None), used)
    if ids.shape[1] > TOP_MAX:
        raise Untrusted(f"its array plp{li}_{r}_2 has {ids.shape[1]} top log-probabilities a token")
    return (logprob, _column(arrays, f"plp{li}_{r}_1", "i", (m,), used), ids,
            _column(arrays, f"plp{li}_{r}_3", "f", (m, ids.shape[1]), used))


def _sequence(s, tokens: np.ndarray, at: int, j: int, arrays: dict, used: set, what: str) -> SequenceState:
    if not isinstance(s, dict):
        raise Untrusted(f"{what} is not an object")
    index = _int(s.get("sample_index"), 0, ID_MAX, f"{what}'s sample_index")
    n = _int(s.get("tokens"), 1, tokens.size - at, f"{what}'s token count")
    finish = s.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise Untrusted(f"{what}'s finish_reason {finish!r:.40} is none of {', '.join(FINISH_REASONS)}")
    stop = s.get("stop_reason")
    if type(stop) is int:
        _int(stop, 0, ID_MAX, f"{what}'s stop_reason")
    elif stop is not None and type(stop) is not str:
        raise Untrusted(f"{what}'s stop_reason is neither a token id nor a string")
    text = _of(s, "text", (str,), what)
    logprobs = _logprobs(arrays, j, n, used) if _of(s, "logprobs", (bool,), what) else []
    return SequenceState(index, tokens[at:at + n].tolist(), logprobs, finish, stop, text)


def _request(req, tokens: np.ndarray, at: int, j: int, arrays: dict, used: set, where: tuple[int, int]):
    """-> (its state, tokens taken, sequences taken)."""
    li, r = where
    what = f"entry {li}'s request {r}"
    if not isinstance(req, dict):
        raise Untrusted(f"{what} is not an object")
    seed = _int(req.get("seed"), 0, SEED_MAX, f"{what}'s seed")
    digest = _hex(req.get("prompt_digest"), f"{what}'s prompt_digest")
    seqs_in = _of(req, "sequences", (list,), what)
    if not seqs_in:
        raise Untrusted(f"{what} saves no sequence")
    seqs = []
    for k, s in enumerate(seqs_in):
        seqs.append(_sequence(s, tokens, at, j + k, arrays, used, f"{what}'s sequence {k}"))
        at += len(seqs[-1].output_ids)
    plp = _prompt_logprobs(arrays, li, r, used) if _of(req, "prompt_logprobs", (bool,), what) else None
    return RequestState(seed, digest, seqs, plp), sum(len(s.output_ids) for s in seqs), len(seqs)


def entries(manifest: dict, arrays: dict[str, np.ndarray]) -> dict:
    """line key -> (custom_id, per prompt of the line: its RequestState or None), every field checked."""
    used = {"tokens"}
    tokens = _column(arrays, "tokens", "i", (None,), used)
    if tokens.size and tokens.min() < 0:
        raise Untrusted("its token ids are out of range")
    lines = manifest.get("lines")
    if not isinstance(lines, list):
        raise Untrusted("its manifest lists no lines")
    out: dict = {}
    at = j = 0
    for li, line in enumerate(lines):
        if not isinstance(line, dict):
            raise Untrusted(f"entry {li} is not an object")
        key = bytes.fromhex(_hex(line.get("key"), f"entry {li}'s key"))
        custom_id = line.get("custom_id")
        if key in out or (custom_id is not None and type(custom_id) is not str):
            raise Untrusted(f"entry {li} repeats a line, or its custom_id is not a string")
        reqs = _of(line, "requests", (list,), f"entry {li}")
        if not reqs or all(req is None for req in reqs):
            raise Untrusted(f"entry {li} saves no request")
        states = []
        for r, req in enumerate(reqs):
            if req is None:
                states.append(None)
                continue
            state, took, seqs = _request(req, tokens, at, j, arrays, used, (li, r))
            states.append(state)
            at, j = at + took, j + seqs
        out[key] = (custom_id, states)
    if at != tokens.size:
        raise Untrusted("it holds more tokens than its manifest lists")
    if arrays.keys() - used:
        raise Untrusted(f"it holds arrays its manifest does not name ({', '.join(sorted(arrays.keys() - used))[:80]})")
    return out
