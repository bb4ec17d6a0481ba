"""`fastdecode generate`: a JSONL batch file in, a JSONL file of completions out.

Requests are read lazily (a bounded look-ahead beyond what the engine runs), outputs written and
flushed as requests finish, and the file sorted into input order at the end.
"""
from __future__ import annotations

import sys
import time

from .batch_io import BatchLine, error_line, read_lines, success_line
from .engine import LLMEngine, RequestError
from .output import OutputWriter
from .progress import Progress


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class BatchRunner:
    def __init__(self, engine: LLMEngine, input_path: str, output_path: str, lookahead: int | None = None):
        self.engine = engine
        self.input_path = input_path
        self.writer = OutputWriter(output_path)
        self.lookahead = lookahead or max(2 * engine.args.max_batch, 64)
        self.lines = read_lines(input_path)
        self.exhausted = False
        self.seen_ids: set[str] = set()
        self.pending: dict[int, BatchLine] = {}    # request index -> its line
        self.num_requests = self.num_errors = 0

    def _error(self, line: BatchLine, code: str, message: str) -> None:
        self.writer.write(line.line_no, error_line(line.custom_id, code, message))
        self.num_errors += 1

    def _submit(self, line: BatchLine) -> None:
        if line.error is not None:
            self._error(line, line.error.code, str(line.error))
            return
        if line.custom_id in self.seen_ids:
            self._error(line, "duplicate_custom_id",
                        f"line {line.line_no}: custom_id {line.custom_id!r} appeared on an earlier line")
            return
        self.seen_ids.add(line.custom_id)
        tok = self.engine.tokenizer
        try:
            if line.is_chat:
                prompt, ids = None, tok.encode_chat(line.messages)
            elif isinstance(line.prompt, list):
                prompt, ids = None, line.prompt
            else:
                prompt, ids = line.prompt, tok.encode(line.prompt)
        except Exception as e:  # a chat template may raise on odd role orders, etc.
            self._error(line, "invalid_prompt", f"cannot tokenize: {type(e).__name__}: {e}")
            return
        try:
            req = self.engine.add_request(line.line_no, line.custom_id, prompt, ids, line.params)
        except RequestError as e:
            self._error(line, e.code, str(e))
            return
        self.pending[req.index] = line

    def _refill(self) -> None:
        sched = self.engine.scheduler
        while not self.exhausted and len(sched.waiting) < self.lookahead:
            line = next(self.lines, None)
            if line is None:
                self.exhausted = True
            else:
                self._submit(line)

    def run(self, sort_output: bool = True, show_progress: bool = True) -> dict:
        eng = self.engine
        total = count_lines(self.input_path)
        start = time.perf_counter()
        with Progress(total, enabled=show_progress) as progress:
            while True:
                self._refill()
                progress.update(0, eng.num_output_tokens)
                if not eng.has_unfinished():
                    if self.exhausted:
                        break
                    continue
                for req in eng.step():
                    line = self.pending.pop(req.index)
                    self.writer.write(line.line_no, success_line(
                        line.custom_id, line.is_chat, eng.source.name, eng.output_of(req), len(req.prompt_ids)))
                    self.num_requests += 1
                    progress.update(1, eng.num_output_tokens)
                progress.done = self.num_requests + self.num_errors
        wall = time.perf_counter() - start
        self.writer.finalize(sort=sort_output)
        return self.summary(wall)

    def summary(self, wall: float) -> dict:
        eng = self.engine
        out = eng.recorder.summary(wall, eng.num_output_tokens, eng.num_prompt_tokens, eng.token_gaps.values())
        out.update(requests=self.num_requests, errors=self.num_errors,
                   requests_per_s=round(self.num_requests / wall, 4) if wall else None)
        return out


def throughput_line(summary: dict) -> str:
    wall = summary["wall_s"] or 1e-9
    return (f"Throughput: {summary['requests'] / wall:.2f} requests/s, "
            f"{(summary['output_tokens'] + summary['prompt_tokens']) / wall:.2f} total tokens/s, "
            f"{summary['output_tokens'] / wall:.2f} output tokens/s")


def print_summary(summary: dict) -> None:
    print(throughput_line(summary), flush=True)
    if summary.get("errors"):
        print(f"fastdecode: {summary['errors']} request line(s) could not be served (see their error field)",
              file=sys.stderr, flush=True)
