"""OUTPUT.fingerprints: which request each output row answers, kept beside the output (vLLM's
row schema stays as it is).

The file is a header line naming the input the output is made from, then one 32-byte record per
row written: the row's digest (its bytes with the newline) and its request's key
(fingerprint.py). A record is flushed before its row, so a row on disk has its record; a crash
between the two leaves a record that matches no row. A row edited by hand or written by another
program has no record: it answers no line, and its line is served again.

The header also names the model the rows were made with, by content (model/identity.py): a
rerun whose `-m` now leads to another model (a `latest` link moved) would mix two models' text
in one output, so it is refused while the output holds rows or a generation saved in flight. An
output recorded before headers named their model is taken as this job's and its header restamped.

An output made from another input is refused (`check`), as is one that holds rows but no record
of what they answer: reusing an output path must never pass another job's answers off as this
input's. `--overwrite` starts over, or a new `-o`.
"""
from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator

from fastdecode.batch.filemode import open_like, open_no_link, replace_atomically
from fastdecode.batch.sidefiles import fingerprints_path, inflight_path, real
from fastdecode.batch.stdio import input_identity
from fastdecode.model.identity import describe, model_identity

FORMAT = "fastdecode request fingerprints"
VERSION = 1
RECORD = 32                     # row digest (16 bytes) + request key (16 bytes)
MAX_HEADER = 1 << 16


class ForeignOutput(ValueError):
    """The output answers another input, or nothing says which: refused before any compute."""


def job_model(args) -> dict:
    """The identity of the model a generate job with these flags serves (model/identity.py)."""
    return model_identity(args.model, getattr(args, "revision", None), getattr(args, "tokenizer", None),
                          getattr(args, "tokenizer_revision", None))


def header_bytes(input_path: str, model: dict | None = None) -> bytes:
    head = {"format": FORMAT, "version": VERSION, "input": input_identity(input_path)}
    if model is not None:
        head["model"] = model
    return (json.dumps(head) + "\n").encode()


def read_header(path: str) -> tuple[dict, int] | None:
    """(the header, its length in bytes) of a fingerprints file; None if missing or not one."""
    try:
        with open(path, "rb") as f:
            line = f.readline(MAX_HEADER)
    except FileNotFoundError:
        return None
    try:
        head = json.loads(line)
    except ValueError:
        return None
    if not line.endswith(b"\n") or not isinstance(head, dict) or head.get("format") != FORMAT \
            or head.get("version") != VERSION or not isinstance(head.get("input"), str):
        return None
    return head, len(line)


def has_rows(path: str, chunk: int = 1 << 20) -> bool:
    """Whether `path` holds a whole line (a partial last line alone is cut off on open)."""
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                if b"\n" in block:
                    return True
    except FileNotFoundError:
        pass
    return False


def check(output: str, input_path: str, overwrite: bool, model: dict | None = None) -> None:
    """Raise ForeignOutput unless a job may append to `output` for `input_path` with `model`
    (its identity; None: not checked)."""
    if overwrite:
        return
    record = fingerprints_path(output)
    found = read_header(record)
    if not has_rows(real(output)):
        if found is not None and model is not None and os.path.exists(inflight_path(output)):
            refuse_other_model(output, found[0], model)     # a save alone is that model's generation too
        return
    restart = f"pass --overwrite to start over with {input_path}, or write to a new -o"
    if found is None:
        what = "is missing" if not os.path.exists(record) else "is not a fingerprints file"
        raise ForeignOutput(f"output {output} holds rows but no record of the requests they answer ({record} "
                            f"{what}): it was not written by this fastdecode, or the record was removed; {restart}")
    made_from = found[0]["input"]
    given = input_identity(input_path)
    if made_from != given:
        raise ForeignOutput(f"output {output} was made from input {made_from}, not {given}: its rows "
                            f"answer that file's lines; {restart}")
    if model is not None:
        refuse_other_model(output, found[0], model)


def refuse_other_model(output: str, head: dict, model: dict) -> None:
    """Raise ForeignOutput if the header names a model other than `model` (by digest)."""
    made_with = head.get("model")
    if not isinstance(made_with, dict) or made_with.get("digest") == model["digest"]:
        return              # the same model (maybe moved), or a header from before models were named
    raise ForeignOutput(f"output {output} was written by model {describe(made_with)[:600]}, not this job's "
                        f"{describe(model)}: its rows and any generation saved in flight are that model's, and "
                        f"resuming would mix two models' text; pass --overwrite to start over with "
                        f"{model['model']}, or write to a new -o")


class Recorder:
    """Appends the record of each row the job writes (flushed before the row itself)."""

    def __init__(self, output: str, input_path: str, fresh: bool, model: dict | None = None):
        self.path = path = fingerprints_path(output)
        found = None if fresh else read_header(path)
        head = header_bytes(input_path, model)
        if found is None or found[0]["input"] != input_identity(input_path):
            with open_like(path, real(output)) as f:
                f.write(head)
                f.flush()
                os.fsync(f.fileno())
        else:
            start = found[1]
            size = os.path.getsize(path)
            whole = start + (size - start) // RECORD * RECORD
            if whole < size:                      # a record cut short by a crash
                os.truncate(path, whole)
            if model is not None and found[0].get("model") != model:    # unnamed before, or moved
                _replace(path, head, _record_chunks(path, start))
        # open for the job's life, closed by close(); never through a link planted meanwhile
        self.f = os.fdopen(open_no_link(path, os.O_WRONLY | os.O_APPEND), "ab")

    def add(self, digest: bytes, key: bytes) -> None:
        self.f.write(digest + key)
        self.f.flush()

    def sync(self) -> None:
        os.fsync(self.f.fileno())

    def close(self) -> None:
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()


def records(output: str, chunk: int = 1 << 14) -> Iterator[list[tuple[bytes, bytes]]]:
    """The (row digest, request key) records of `output`, a list per chunk read; none if the file
    is missing or not a fingerprints file."""
    path = fingerprints_path(output)
    found = read_header(path)
    if found is None:
        return
    with open(path, "rb") as f:
        f.seek(found[1])
        while data := f.read(RECORD * chunk):
            n = len(data) // RECORD
            yield [(data[i * RECORD:i * RECORD + 16], data[i * RECORD + 16:(i + 1) * RECORD]) for i in range(n)]


def compact(output: str, pairs: Iterator[tuple[bytes, bytes]]) -> None:
    """Rewrite the record with only `pairs` (the rows the rewritten output kept), atomically."""
    path = fingerprints_path(output)
    found = read_header(path)
    if found is None:
        return
    with open(path, "rb") as f:
        head = f.read(found[1])
    _replace(path, head, (digest + key for digest, key in pairs))


def _record_chunks(path: str, start: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        while data := f.read(chunk):
            yield data


def _replace(path: str, head: bytes, body: Iterator[bytes]) -> None:
    """Replace `path` by `head` and `body`, atomically (a temporary file renamed over it)."""
    replace_atomically(path, path, itertools.chain([head], body))
