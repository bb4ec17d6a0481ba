"""What model a job serves, by content: the identity an output's rows and its in-flight save are
bound to (batch/binding.py, batch/inflight.py), so a rerun with another model behind the same
`-m` (a `latest` link moved, a directory overwritten) is found before any compute.

The digest covers the config and tokenizer files (JSON canonicalized: reformatting does not
count), each weight file's name, size and header, and a sample of its tensor bytes. Headers alone
do not tell a fine-tune from its base (same names, shapes and offsets), so the bytes are sampled:
the first and last SAMPLE bytes of every tensor of a safetensors file, the first HEAD bytes of a
GGUF file (its metadata and vocabulary) and SAMPLES evenly spaced blocks of the rest. Any retrained
or converted model differs there; a hand edit of a few weights between the samples does not.
Reading costs a few MiB per model however large it is, so the check runs at every start.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

from fastdecode.model.source import ModelSource, resolve_model

SAMPLE = 4096                  # bytes read at each end of a tensor / per sampled block
HEAD = 32 << 20                # a GGUF file's leading bytes hashed whole: metadata, vocabulary, tensor index
SAMPLES = 1024                 # evenly spaced blocks sampled from the rest of a GGUF file
MAX_HEADER = 100 << 20         # the safetensors format's own bound on its JSON header
SIDE_SUFFIXES = (".json", ".model", ".jinja", ".tiktoken")     # config, tokenizer, generation config
SIDE_NAMES = ("merges.txt", "vocab.txt")


def model_identity(model: str, revision: str | None = None, tokenizer: str | None = None,
                   tokenizer_revision: str | None = None) -> dict:
    """{"model": `-m` as given, "path": what it resolved to, "digest": hex} of the model a job
    with these flags serves (--tokenizer's files included where given). Raises ConfigError
    as resolve_model does, OSError where a file cannot be read."""
    source = resolve_model(model, revision)
    h = hashlib.blake2b(digest_size=16)
    h.update(source.kind.encode() + b"\0")
    _hash_source(h, source)
    if tokenizer is not None:
        h.update(b"\0tokenizer\0")
        _hash_tokenizer(h, resolve_model(tokenizer, tokenizer_revision))
    path = source.path if source.kind == "random" else os.path.realpath(source.path)
    return {"model": model, "path": path, "digest": h.hexdigest()}


def describe(identity: dict) -> str:
    """`-m` as given, where it led and a short digest: enough to tell two models apart."""
    where = "" if identity.get("path") == identity.get("model") else f"{identity.get('path')}, "
    return f"{identity.get('model')} ({where}identity {str(identity.get('digest'))[:12]})"


def _hash_source(h, source: ModelSource) -> None:
    if source.kind == "random":            # its weights follow from the spec (a fixed seed)
        h.update(source.path.encode())
    elif source.kind == "gguf":
        _hash_gguf(h, source.path)
    else:
        _hash_side_files(h, source.path)
        for name in sorted(f for f in os.listdir(source.path) if f.endswith(".safetensors")):
            _hash_safetensors(h, os.path.join(source.path, name), name)


def _hash_tokenizer(h, source: ModelSource) -> None:
    if source.kind == "gguf":
        _hash_gguf(h, source.path, samples=0)       # the vocabulary is in the head
    elif source.kind == "hf":
        _hash_side_files(h, source.path)


def _hash_side_files(h, directory: str) -> None:
    names = sorted(f for f in os.listdir(directory) if f.endswith(SIDE_SUFFIXES) or f in SIDE_NAMES)
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if name.endswith(".json"):
            try:
                data = json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
            except ValueError:
                pass                       # hashed as it is; the config check names a bad config
        h.update(f"\0{name}\0{len(data)}\0".encode() + data)


def _hash_safetensors(h, path: str, name: str) -> None:
    """The file's name, size and header, and both ends of every tensor's bytes."""
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        header = os.pread(fd, min(n, MAX_HEADER), 8)
        h.update(f"\0{name}\0{size}\0".encode() + header)
        try:
            tensors = json.loads(header)
        except ValueError:
            tensors = {}                   # the loader names a damaged file; its bytes are still hashed
        spans = sorted(tuple(t["data_offsets"]) for k, t in tensors.items()
                       if k != "__metadata__" and isinstance(t, dict) and isinstance(t.get("data_offsets"), list)
                       and len(t["data_offsets"]) == 2) if isinstance(tensors, dict) else []
        base = 8 + n
        for start, end in spans or [(0, max(size - base, 0))]:
            start, end = base + int(start), base + int(end)
            h.update(os.pread(fd, min(SAMPLE, max(end - start, 0)), start))
            if end - start > SAMPLE:
                h.update(os.pread(fd, SAMPLE, end - SAMPLE))


def _hash_gguf(h, path: str, samples: int = SAMPLES) -> None:
    """The file's size, its head whole, and `samples` evenly spaced blocks of the rest."""
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        h.update(f"\0gguf\0{size}\0".encode())
        head = min(size, HEAD)
        for off in range(0, head, 1 << 20):
            h.update(os.pread(fd, min(1 << 20, head - off), off))
        rest = size - head
        if rest <= 0 or samples <= 0:
            return
        step = max(rest // samples, 1)
        for off in range(head, size, step):
            h.update(os.pread(fd, min(SAMPLE, size - off), off))
