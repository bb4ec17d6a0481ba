"""OUTPUT.inflight: the generation a stop found in flight, kept so that the rerun continues it.

On a stop (SIGUSR1, SIGTERM, SIGINT) rank 0 finishes the step, writes the rows that are done,
then saves, for every line whose row is not written yet, each of its requests' generation so far
(engine/continuation.py): the generated token ids, the seed, the log-probabilities returned so
far, and the samples that finished while others of the line ran on. The rerun prefills each prompt
with its saved tokens and goes on from there, so greedy and seeded sampling give the text an
uninterrupted run gives. Lines a stop found queued but not started, and prompts in a chunked
prefill, start over.

The file is MAGIC, the SHA-256 of the rest, then a numpy .npz archive (no pickles, arrays stored
as they are) of a JSON manifest and the arrays; written to a temporary file beside it (a random
name) with the output's mode, fsynced and renamed over the old one. On load the checksum, the
format, the output, input and model it was saved for and every field are checked
(inflight_read.py: a checksum is no proof against a forged file, nor a size against a deflate
bomb): a file that fails is named on stderr and ignored (its sequences start over), never
trusted; each entry is checked again against its request when its line is served (the prompt's
tokens, the samples, the lengths, how a finished sample finished). Entries of lines this run did
not reach are carried into the next save; the file is removed once the rows of the lines it holds
are written, and when a run gets through the input.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys

import numpy as np

from fastdecode.batch import inflight_kv, inflight_read
from fastdecode.batch.filemode import replace_atomically
from fastdecode.batch.inflight_read import Untrusted
from fastdecode.engine.continuation import RequestState

MAGIC = b"fastdecode in-flight v1\n"
FORMAT = "fastdecode in-flight sequences"
VERSION = 1

Entry = tuple[str | None, list[RequestState | None]]      # (custom_id, per prompt of the line: its state)


# ---------------------------------------------------------------------------- writing

def _pack(entries: dict[bytes, Entry]) -> tuple[dict, dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}
    tokens: list[list[int]] = []
    lines = []
    for key, (custom_id, states) in entries.items():
        reqs = []
        for state in states:
            if state is None:
                reqs.append(None)
                continue
            seqs = []
            for s in state.sequences:
                j = len(tokens)
                tokens.append(s.output_ids)
                if s.logprobs:
                    chosen, rank, ids, top = zip(*s.logprobs)
                    arrays[f"lp{j}_chosen"] = np.asarray(chosen, np.float32)
                    arrays[f"lp{j}_rank"] = np.asarray(rank, np.int64)
                    arrays[f"lp{j}_ids"] = np.stack(ids).astype(np.int64)
                    arrays[f"lp{j}_top"] = np.stack(top).astype(np.float32)
                seqs.append({"sample_index": s.sample_index, "tokens": len(s.output_ids), "logprobs": bool(s.logprobs),
                             "finish_reason": s.finish_reason, "stop_reason": s.stop_reason, "text": s.text})
            r = len(reqs)
            if state.prompt_logprobs is not None:
                for c, col in enumerate(state.prompt_logprobs):
                    arrays[f"plp{len(lines)}_{r}_{c}"] = np.asarray(col)
            reqs.append({"seed": state.seed, "prompt_digest": state.prompt_digest,
                         "prompt_logprobs": state.prompt_logprobs is not None, "sequences": seqs})
        lines.append({"key": key.hex(), "custom_id": custom_id, "requests": reqs})
    arrays["tokens"] = np.asarray([t for ts in tokens for t in ts], np.int64)
    return {"lines": lines}, arrays


def save(path: str, like: str, identity: dict, entries: dict[bytes, Entry]) -> tuple[int, int]:
    """Write `entries` (line key -> entry) to `path` atomically, with the mode of `like`; none:
    remove the file. identity: what it is saved for (output, input, model). -> (sequences, tokens)."""
    if not entries:
        discard(path)
        return 0, 0
    manifest, arrays = _pack(entries)
    manifest.update(format=FORMAT, version=VERSION, **identity)
    buf = io.BytesIO()
    np.savez(buf, manifest=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **arrays)
    payload = buf.getvalue()
    replace_atomically(path, like, [MAGIC, hashlib.sha256(payload).digest(), payload])
    seqs = sum(len(s.sequences) for _, states in entries.values() for s in states if s is not None)
    return seqs, int(arrays["tokens"].size)


def discard(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def discard_save(path: str) -> None:
    """The save at `path` and the KV saved beside it (inflight_kv.py)."""
    discard(path)
    inflight_kv.discard(inflight_kv.kv_path(path))


# ---------------------------------------------------------------------------- reading

def read(path: str, identity: dict) -> dict[bytes, Entry]:
    """The entries of the file at `path`, saved for `identity`, every field checked
    (inflight_read.py); raises Untrusted saying why not."""
    manifest, arrays = inflight_read.load(path, MAGIC)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise Untrusted(f"format {str(manifest.get('format'))[:60]!r} version {str(manifest.get('version'))[:20]!r}, "
                        f"expected {FORMAT!r} version {VERSION}")
    for what, want in identity.items():
        if manifest.get(what) != want:
            raise Untrusted(f"saved for {what} {str(manifest.get(what))[:200]!r}, not this job's {want!r}")
    return inflight_read.entries(manifest, arrays)


class Saved:
    """The in-flight save a run starts from: entries handed out by line key as lines are served."""

    def __init__(self, path: str, identity: dict):
        self.path, self.identity = path, identity
        self.entries: dict[bytes, Entry] = {}
        self.seen: set[bytes] = set()           # keys of lines this run read (an entry used or outdated)
        self.open: set[bytes] = set()           # keys taken whose rows are not written yet
        self.continued_seqs = self.continued_tokens = 0
        self.refused: list[str] = []
        self.kv = None                          # the saved KV beside it (inflight_kv.py), if any
        if not os.path.exists(path):
            inflight_kv.discard(inflight_kv.kv_path(path))      # KV of no save is of no use
            return
        try:
            self.entries = read(path, identity)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the job goes on without it
            why = str(e) if isinstance(e, (OSError, Untrusted)) else f"{type(e).__name__}: {e}"
            print(f"fastdecode: {path}: ignored, not trusted ({why[:300]}); the sequences it held start over",
                  file=sys.stderr, flush=True)
        if self.entries:
            self.kv = inflight_kv.SavedKV(inflight_kv.kv_path(path), inflight_kv.inflight_digest(path, MAGIC))

    def take(self, key: bytes) -> list[RequestState | None] | None:
        """The saved states of the line with `key` (per prompt), once; None if none."""
        self.seen.add(key)
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.open.add(key)
        if self.kv is not None:              # each unfinished sample's saved KV, where the stop kept it
            for k, state in enumerate(entry[1]):
                for s in state.sequences if state is not None else ():
                    s.kv = self.kv.take(key, k, s.sample_index)
        return entry[1]

    def note_used(self, states: list[RequestState | None], refused: list[str | None], line_no: int) -> None:
        for state, why in zip(states, refused):
            if state is None:
                continue
            if why is None:
                self.continued_seqs += len(state.sequences)
                self.continued_tokens += sum(len(s.output_ids) for s in state.sequences)
            else:
                self.refused.append(f"line {line_no}: {why}")
                print(f"fastdecode: {self.path}: the saved sequences of line {line_no} do not fit its request "
                      f"({why}); they start over", file=sys.stderr, flush=True)

    def written(self, key: bytes) -> None:
        """The line's row is written: once every taken line's is, and none is left to take, the
        file has served its purpose."""
        self.open.discard(key)
        if self.entries and not self.open and not (self.entries.keys() - self.seen):
            self.entries = {}
            discard_save(self.path)

    def carried(self) -> dict[bytes, Entry]:
        """Entries of lines this run did not reach: kept for the next run."""
        return {k: v for k, v in self.entries.items() if k not in self.seen}

    def carried_kv(self) -> list[inflight_kv.Item]:
        """The saved KV of the carried entries' sequences (their bytes checked; damaged ones left out)."""
        if self.kv is None:
            return []
        keep = self.carried().keys()
        out = []
        for (key, prompt, sample), rec in list(self.kv.records.items()):
            if key in keep:
                try:
                    out.append(inflight_kv.Item(key, prompt, sample, rec.tokens, rec.layout, bytes(rec.blob())))
                except Untrusted:
                    pass
        return out
