"""A batch line as engine requests: one per prompt (a completions line may carry a list of
prompts, OpenAI's batched prompts), answered together in one row once all are finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastdecode.batch.jsonl import BatchLine
from fastdecode.engine.request_checks import RequestError
from fastdecode.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class PendingLine:
    line: BatchLine
    answers: list            # per prompt: its responses.Answer once finished, else None
    key: bytes = b""         # what its row is recorded under (resume.Claim.key)
    requests: list = field(default_factory=list)   # per prompt: the engine's Request


def encode_prompts(tokenizer, line: BatchLine) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each of the line's prompts; a chat line has one."""
    if line.is_chat:
        return [(None, tokenizer.encode_chat(line.messages))]
    return [(None, list(p)) if isinstance(p, list) else (p, tokenizer.encode(p)) for p in line.prompts]


def request_id(line: BatchLine, k: int, count: int) -> str:
    """The engine's id of the line's k-th prompt (it seeds a request that names no seed)."""
    return line.custom_id if count == 1 else f"{line.custom_id}[{k}]"


def check_prompts(engine, prompts: list[tuple[str | None, list[int]]], params: SamplingParams) -> None:
    """Check every prompt of a line before any is queued, so a line is served whole or answered by
    one error naming the prompt at fault; the line's prompts together may pin at most
    --max-request-mem on rank 0 (they are held until the row is written)."""
    total = 0
    for k, (_, ids) in enumerate(prompts):
        try:
            total += engine.check_request(ids, params).pinned_bytes
        except RequestError as e:
            raise RequestError(f"body.prompt[{k}]: {e}", e.code) from None
    limit = engine.args.max_request_mem
    if total > limit:
        raise RequestError(f"the line's {len(prompts)} prompts would hold about {total / 2**20:,.0f} MiB on rank 0 "
                           f"together, more than --max-request-mem {limit / 2**20:,.0f} MiB",
                           code="request_too_large")
