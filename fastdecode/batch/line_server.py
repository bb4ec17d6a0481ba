"""The engine's side of serving batch lines: a claimed line's prompts queued as requests, its
row built once all of them finished, the generation in flight captured for a stop's save. Where
the rows go is the subclass's (`_write`): the output file (serve.py's BatchRunner), or the job's
dealer when this engine is one data-parallel group of several (group_runner.py)."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from fastdecode.batch import inflight
from fastdecode.batch.jsonl import BatchLine
from fastdecode.batch.line_requests import PendingLine, check_prompts, encode_prompts, request_id
from fastdecode.batch.responses import Answer, error_line, success_line
from fastdecode.engine.continuation import capture
from fastdecode.engine.request_checks import RequestError

if TYPE_CHECKING:                 # the engine (torch) loads only when a line needs serving
    from fastdecode.engine.llm_engine import LLMEngine


class LineServer:
    """Queues claimed lines on `engine` and writes one row per line through `_write`. saved: what
    notes the use of an earlier run's saved generation (inflight.Saved, or a stand-in that passes
    the notes on)."""

    def __init__(self, engine: LLMEngine, saved: inflight.Saved | None = None):
        self.engine, self.saved = engine, saved
        self.pending: dict[int, tuple[PendingLine, int]] = {}    # request index -> its line, which prompt
        self._next_index = 0
        self.num_requests = 0                      # served this run
        self.errors: Counter[str] = Counter()      # error rows this run, by code

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def _write(self, line_no: int, obj: dict, code: str | None, key: bytes) -> None:
        raise NotImplementedError

    def _error(self, line: BatchLine, key: bytes, code: str, message: str, status: int = 400) -> None:
        self._write(line.line_no, error_line(line.custom_id, code, message, status), code, key)
        self.errors[code] += 1

    def _serve(self, line: BatchLine, key: bytes, saved: list | None) -> None:
        """Queue a claimed line's requests (or write its error row)."""
        try:
            prompts = encode_prompts(self.engine.tokenizer, line)
        except Exception as e:  # a chat template may raise on odd role orders, etc.
            self._error(line, key, "invalid_prompt", f"cannot tokenize: {type(e).__name__}: {e}")
            return
        if saved is not None and len(saved) != len(prompts):
            self.saved.note_used(saved, [f"{len(saved)} prompts saved, the line has {len(prompts)}"] * len(saved),
                                 line.line_no)
            saved = None
        try:
            if len(prompts) > 1:            # all of a line or none: checked before any is queued
                check_prompts(self.engine, prompts, line.params)
            reqs = [self.engine.add_request(self._next_index + k, request_id(line, k, len(prompts)), text, ids,
                                            line.params, resume=saved[k] if saved is not None else None)
                    for k, (text, ids) in enumerate(prompts)]
        except RequestError as e:
            self._error(line, key, e.code, str(e))
            return
        self._next_index += len(reqs)
        pending = PendingLine(line, [None] * len(reqs), key, reqs)
        for k, req in enumerate(reqs):
            self.pending[req.index] = (pending, k)
        if saved is not None:
            self.saved.note_used(saved, [r.meta.get("resume_refused") for r in reqs], line.line_no)
        for req in reqs:
            if req.finished:                # every sample had finished before the stop
                self._finished(req)

    def _answer(self, line: BatchLine, req) -> Answer:
        """One finished request (one prompt of a line) as its part of the line's row."""
        tok = self.engine.tokenizer
        echo = None
        if line.echo:
            echo = req.prompt if req.prompt is not None else tok.decode(req.prompt_ids, False)
        return Answer(self.engine.output_of(req), len(req.prompt_ids), echo, tok.token_text(req.prompt_ids[0]))

    def _finished(self, req) -> None:
        """A request is done: its line's row is written once all of the line's prompts are."""
        pending, k = self.pending.pop(req.index)
        pending.answers[k] = self._answer(pending.line, req)
        if any(a is None for a in pending.answers):
            return
        line = pending.line
        row = success_line(line.custom_id, line.is_chat, self.engine.served.reported, pending.answers,
                           line.params.logprobs or 0, line.echo_only)
        self._write(line.line_no, row, None, pending.key)
        self.num_requests += 1

    def in_flight(self) -> dict[bytes, inflight.Entry]:
        """Every line whose row is not written: its requests' generation so far (those with any)."""
        out: dict[bytes, inflight.Entry] = {}
        for pending in {id(p): p for p, _ in self.pending.values()}.values():
            states = [capture(req) for req in pending.requests]
            if any(st is not None for st in states):
                out[pending.key] = (pending.line.custom_id, states)
        return out
