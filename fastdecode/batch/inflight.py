"""OUTPUT.inflight: the generation a stop found in flight, kept so that the rerun continues it.

On a stop (SIGUSR1, SIGTERM, SIGINT) rank 0 finishes the step, writes the rows that are done,
then saves, for every line whose row is not written yet, each of its requests' generation so far
(engine/continuation.py): the generated token ids, the seed, the log-probabilities returned so
far, and the samples that finished while others of the line ran on. The rerun prefills each prompt
with its saved tokens and goes on from there, so greedy and seeded sampling give the text an
uninterrupted run gives. Lines a stop found queued but not started, and prompts in a chunked
prefill, start over.

The file is MAGIC, the SHA-256 of the rest, then a numpy .npz archive (no pickles) of a JSON
manifest and the arrays; written to a temporary file beside it (a random name) with the output's
mode, fsynced and renamed over the old one. On load the checksum, the format and the output, input and model it was
saved for are checked: a file that fails is named on stderr and ignored (its sequences start
over), never trusted; each entry is checked again against its request when its line is served
(the prompt's tokens, the samples, the lengths). Entries of lines this run did not reach are
carried into the next save; the file is removed once the rows of the lines it holds are written,
and when a run gets through the input.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import zipfile

import numpy as np

from fastdecode.batch.filemode import fsync_dir, temp_like
from fastdecode.engine.continuation import RequestState, SequenceState

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
    f, tmp = temp_like(path, like)
    try:
        with f:
            f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path)
    except BaseException:
        discard(tmp)
        raise
    seqs = sum(len(s.sequences) for _, states in entries.values() for s in states if s is not None)
    return seqs, int(arrays["tokens"].size)


def discard(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------- reading

class Untrusted(ValueError):
    pass


def _unpack(manifest: dict, arrays) -> dict[bytes, Entry]:
    tokens = arrays["tokens"]
    out: dict[bytes, Entry] = {}
    at = j = 0
    for li, line in enumerate(manifest["lines"]):
        states: list[RequestState | None] = []
        for r, req in enumerate(line["requests"]):
            if req is None:
                states.append(None)
                continue
            seqs = []
            for s in req["sequences"]:
                n = int(s["tokens"])
                ids = tokens[at:at + n].tolist()
                if len(ids) != n:
                    raise Untrusted("fewer tokens than its manifest lists")
                at += n
                logprobs = []
                if s["logprobs"]:
                    chosen, rank = arrays[f"lp{j}_chosen"], arrays[f"lp{j}_rank"]
                    top_ids, top = arrays[f"lp{j}_ids"], arrays[f"lp{j}_top"]
                    logprobs = [(float(chosen[i]), int(rank[i]), top_ids[i], top[i]) for i in range(len(chosen))]
                j += 1
                seqs.append(SequenceState(int(s["sample_index"]), ids, logprobs, s["finish_reason"],
                                          s["stop_reason"], str(s["text"])))
            plp = tuple(arrays[f"plp{li}_{r}_{c}"] for c in range(4)) if req["prompt_logprobs"] else None
            states.append(RequestState(int(req["seed"]), str(req["prompt_digest"]), seqs, plp))
        out[bytes.fromhex(line["key"])] = (line["custom_id"], states)
    if at != tokens.size:
        raise Untrusted("more tokens than its manifest lists")
    return out


def read(path: str, identity: dict) -> dict[bytes, Entry]:
    """The entries of the file at `path`, saved for `identity`; raises Untrusted saying why not."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise Untrusted("not an in-flight save of fastdecode")
    digest, payload = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise Untrusted("its checksum does not match: the file is damaged")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        manifest = json.loads(arrays.pop("manifest").tobytes())
    except (ValueError, KeyError, OSError, zipfile.BadZipFile) as e:
        raise Untrusted(f"cannot be read: {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise Untrusted(f"format {manifest.get('format')!r} version {manifest.get('version')!r}, expected "
                        f"{FORMAT!r} version {VERSION}")
    for what, want in identity.items():
        if manifest.get(what) != want:
            raise Untrusted(f"saved for {what} {manifest.get(what)!r}, not this job's {want!r}")
    try:
        return _unpack(manifest, arrays)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise Untrusted(f"its manifest does not fit its arrays ({type(e).__name__}: {e})") from None


class Saved:
    """The in-flight save a run starts from: entries handed out by line key as lines are served."""

    def __init__(self, path: str, identity: dict):
        self.path, self.identity = path, identity
        self.entries: dict[bytes, Entry] = {}
        self.seen: set[bytes] = set()           # keys of lines this run read (an entry used or outdated)
        self.open: set[bytes] = set()           # keys taken whose rows are not written yet
        self.continued_seqs = self.continued_tokens = 0
        self.refused: list[str] = []
        if not os.path.exists(path):
            return
        try:
            self.entries = read(path, identity)
        except (OSError, Untrusted) as e:
            print(f"fastdecode: {path}: ignored, not trusted ({e}); the sequences it held start over",
                  file=sys.stderr, flush=True)

    def take(self, key: bytes) -> list[RequestState | None] | None:
        """The saved states of the line with `key` (per prompt), once; None if none."""
        self.seen.add(key)
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.open.add(key)
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
            discard(self.path)

    def carried(self) -> dict[bytes, Entry]:
        """Entries of lines this run did not reach: kept for the next run."""
        return {k: v for k, v in self.entries.items() if k not in self.seen}
