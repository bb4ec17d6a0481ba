"""Sequences a stop saved with their KV (batch/inflight_kv.py, `--save-kv-on-stop`) get it back
instead of a prefill: once the scheduler has placed them, their worker imports the saved bytes
(RBackend.import_kv) and they decode from this step on, as if prefilled there.

A sequence is recomputed instead (prefilled with its tokens as any continued one) where its worker
keeps no importable KV (the S-worker's own tier), its worker's layout differs from the saved one,
the bytes are damaged or for other tokens, it shares a prefix placement found for it, or the
worker has no room or refuses the bytes, or the S-worker is tensor-parallel; the first of each
cause is named on stderr.
"""
from __future__ import annotations

import sys

from fastdecode.engine.sequence import Sequence, Status
from fastdecode.rpart.base import KVImportError


class Reloader:
    def __init__(self):
        self.tokens = 0            # KV tokens reloaded instead of recomputed (the report's reloaded_tokens)
        self.sequences = 0
        self._said: set[str] = set()

    def __call__(self, eng, new: list[Sequence]) -> list[Sequence]:
        """Import the saved KV of this step's placed sequences that have one; -> those left to prefill."""
        if not any(s.saved_kv is not None for s in new):
            return new
        if eng.tp is not None:                # the followers would need telling: recomputed as before
            for s in new:
                s.saved_kv = None
            self._say("a tensor-parallel S-worker recomputes saved sequences")
            return new
        layouts = eng.backend.kv_layouts()
        by_worker: dict[int, list[tuple[Sequence, memoryview]]] = {}
        for s in new:
            rec, s.saved_kv = s.saved_kv, None
            if rec is None or s.prefilled:
                continue
            why = rec.refusal(s.kv_len, layouts[s.worker]) or \
                ("it shares a prefix another sequence holds" if eng.placement.shared_tokens(s) else None)
            try:
                blob = rec.blob() if why is None else None
            except ValueError as e:            # damaged bytes (inflight_kv.Record.blob)
                why = str(e)
            if why is not None:
                self._say(why)
                continue
            by_worker.setdefault(s.worker, []).append((s, blob))
        done: set[int] = set()
        for w, pairs in by_worker.items():
            try:
                ok = eng.backend.import_kv(w, [s.seq_id for s, _ in pairs], [b for _, b in pairs])
            except KVImportError as e:        # the worker refused some blobs (named); it took the others
                self._say(str(e))
                ok = e.stored
            for (s, _), imported in zip(pairs, ok):
                if not imported:
                    self._say("its worker has no room for it now")
                    continue
                s.prefilled = s.prefill_to = 0
                s.status = Status.RUNNING
                if eng.prefix is not None:
                    eng.prefix.not_prefilled(s)
                done.add(s.seq_id)
                self.tokens += s.kv_len
                self.sequences += 1
        return [s for s in new if s.seq_id not in done]

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            print(f"fastdecode: a saved sequence's KV is recomputed, not reloaded: {why}", file=sys.stderr, flush=True)
