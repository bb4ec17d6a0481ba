"""OpenAI batch JSONL input (what `vllm run-batch` reads): request lines read and parsed one at a
time, never the whole file.

A line is bytes up to a LF (a CR inside a line is part of it), at most --max-line-bytes, UTF-8.
Its JSON is parsed without recursion or number-size hazards (pydantic_core) and checked against
the schema (schema.py) and the job's limits. A line that cannot be served becomes a 400 row
naming the problem; nothing a line holds can stop the batch: any exception while reading,
parsing or validating one line becomes that line's error.
"""
from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pydantic_core
from pydantic import ValidationError

from fastdecode.batch.fingerprint import line_digest, raw_digest
from fastdecode.batch.schema import Body, Envelope, Limits, check_limits, describe
from fastdecode.engine.sampling_params import SamplingParams
from fastdecode.model.names import ServedModel

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "min_tokens", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words")
# Fields that would change the output but are not implemented, and what they ask for: a
# request that uses one gets a 400 instead of an answer that silently ignores it.
_UNSUPPORTED = {"suffix": "suffixes", "use_beam_search": "beam search", "tools": "tool calls",
                "response_format": "structured output", "guided_json": "structured output",
                "guided_regex": "structured output", "guided_choice": "structured output",
                "guided_grammar": "structured output", "structured_outputs": "structured output",
                "logits_processors": "logits processors", "truncate_prompt_tokens": "prompt truncation",
                "chat_template": "custom chat templates", "chat_template_kwargs": "chat template arguments",
                "continue_final_message": "continuing the final message",
                "functions": "function calls", "function_call": "function calls", "tool_choice": "tool calls"}
_NONE_ALLOWED = ("tool_choice", "function_call")     # "none": no call, the answer a plain model gives
# where a line's JSON is broken, its custom_id is still worth naming in the error row
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*"([^"\\\x00-\x1f]{1,256})"')


class LineError(ValueError):
    def __init__(self, message: str, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


@dataclass(slots=True)
class BatchLine:
    line_no: int                     # 1-based line number in the input file
    custom_id: str | None
    url: str | None = None
    prompts: list[str | list[int]] | None = None   # completions: one or more prompts (text or token ids)
    messages: list[dict] | None = None
    params: SamplingParams | None = None
    echo: bool = False               # completions: the prompt goes before the completion (and its logprobs)
    echo_only: bool = False          # ... with max_tokens 0: the prompt alone (one token is generated, unused)
    error: LineError | None = None
    digest: bytes = b""              # the request's fingerprint (fingerprint.py); b"": a line too long to read

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT


# ---------------------------------------------------------------------------- reading

def read_lines(path: str, limits: Limits = Limits(), served: ServedModel | None = None) -> Iterator[BatchLine]:
    """Stream the input file: one BatchLine per line that is not blank (their numbers still count).
    served: the job's model names, which a line's body.model must match (None: any)."""
    for line_no, raw in raw_lines(path, limits.max_line_bytes):
        if raw is None:
            yield BatchLine(line_no, None, error=LineError(
                f"line {line_no}: longer than --max-line-bytes {limits.max_line_bytes}", code="request_too_large"))
        elif raw.strip():
            yield parse_line(line_no, raw, limits, served)


COUNT_CHUNK = 1 << 20


def count_lines(path: str, chunk_bytes: int = COUNT_CHUNK) -> int:
    """Lines that are not blank (as read_lines yields them), counted in chunks: memory is one chunk
    whatever a line's length (a line of gigabytes without a newline is one line, read once)."""
    count, pending = 0, False        # pending: the line being read has a non-blank byte so far
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            pieces = chunk.split(b"\n")
            for piece in pieces[:-1]:                      # each ends a line
                if pending or piece.strip():
                    count += 1
                pending = False
            pending = pending or bool(pieces[-1].strip())
    return count + pending


def raw_lines(path: str, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) of every LF-terminated line; None for a line over max_bytes, whose
    rest is skipped without being held in memory. A UTF-8 byte order mark (editors on Windows
    write one) is not part of line 1."""
    with open(path, "rb") as f:
        line_no = 0
        while True:
            data = f.readline(max_bytes + 1)
            if not data:
                return
            line_no += 1
            if line_no == 1 and data.startswith(codecs.BOM_UTF8):
                data = data[len(codecs.BOM_UTF8):]
            if len(data) > max_bytes and not data.endswith(b"\n"):
                while data and not data.endswith(b"\n"):
                    data = f.readline(1 << 20)
                yield line_no, None
            else:
                yield line_no, data


# ---------------------------------------------------------------------------- parsing

def parse_line(line_no: int, raw: bytes | str, limits: Limits = Limits(), served: ServedModel | None = None) -> BatchLine:
    """One input line -> BatchLine; problems are recorded in .error, never raised. A body.model
    that `served` does not answer to is a 404 model_not_found, after the schema, as in vLLM."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    custom_id = None
    digest = b""
    try:
        try:
            obj = pydantic_core.from_json(data)
        except ValueError as e:
            found = _CUSTOM_ID.search(data)
            custom_id = found.group(1).decode("utf-8", "replace") if found else None
            raise LineError(f"line {line_no}: not valid JSON in UTF-8 ({e})") from None
        digest = line_digest(obj, data)
        if not isinstance(obj, dict):
            raise LineError(f"line {line_no}: expected a JSON object")
        cid = obj.get("custom_id")
        custom_id = cid if isinstance(cid, str) and cid else None
        if custom_id is None:
            raise LineError(f"line {line_no}: missing or non-string custom_id")
        if obj.get("url") not in (COMPLETIONS, CHAT):
            raise LineError(f"unsupported url {obj.get('url')!r}: expected {COMPLETIONS} or {CHAT}", code="invalid_url")
        env = _validated(Envelope, obj, "line")
        _reject_unsupported(env.body, env.url)
        body = _validated(Body, env.body, "body")
        unknown = served.mismatch(body.model) if served is not None else None
        if unknown:
            raise LineError(unknown, code="model_not_found", status=404)
        too_much = check_limits(body, limits)
        if too_much:
            raise LineError(too_much, code="request_too_large")
        line = _request(line_no, custom_id, env.url, body)
        line.digest = digest
        return line
    except LineError as e:
        return BatchLine(line_no, custom_id, error=e, digest=digest or raw_digest(data))
    except Exception as e:  # noqa: BLE001 - one line must never end the batch
        return BatchLine(line_no, custom_id, error=LineError(
            f"line {line_no}: cannot be read: {type(e).__name__}: {str(e)[:200]}"), digest=digest or raw_digest(data))


def _validated(model, obj: dict, where: str):
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise LineError(describe(e, where)) from None


def _reject_unsupported(body: dict, url: str) -> None:
    if url == CHAT and body.get("echo"):    # vLLM's chat echo repeats the last message; not implemented
        raise LineError(f"body.echo: echoing the last message is not supported by fastdecode for {CHAT}",
                        code="unsupported_parameter")
    for name, what in _UNSUPPORTED.items():
        val = body.get(name)
        if val in (None, False, "", [], {}) or (name == "response_format" and val == {"type": "text"}) or \
                (name in _NONE_ALLOWED and val == "none"):
            continue
        raise LineError(f"body.{name}: {what} is not supported by fastdecode", code="unsupported_parameter")
    if body.get("add_generation_prompt", True) is not True:
        raise LineError("body.add_generation_prompt: only true (the default) is supported by fastdecode",
                        code="unsupported_parameter")
    best_of, n = body.get("best_of"), body.get("n", 1)
    if best_of is not None and best_of != n:
        raise LineError(f"body.best_of ({best_of!r}) other than n is not supported by fastdecode",
                        code="unsupported_parameter")


def _request(line_no: int, custom_id: str, url: str, body: Body) -> BatchLine:
    """A validated body -> the line's prompt or messages and its SamplingParams."""
    line = BatchLine(line_no, custom_id, url)
    if url == CHAT:
        if not body.messages:
            raise LineError("body.messages must be a non-empty list of {role, content} objects")
        line.messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = _chat_logprobs(body)
    else:
        line.prompts = _prompts(body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens     # the completions API's default
        line.echo = bool(body.echo)
        if line.echo and max_tokens == 0:          # scoring a text: vLLM's echo without generation
            line.echo_only, max_tokens = True, 1
        logprobs = _completion_logprobs(body)
    kwargs = {k: getattr(body, k) for k in _PARAM_FIELDS if getattr(body, k) is not None}
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and line.echo:      # echoed tokens carry logprobs like the generated ones
        prompt_logprobs = logprobs
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    if body.logit_bias:
        kwargs["logit_bias"] = body.logit_bias
    try:
        line.params = SamplingParams(max_tokens=max_tokens, **kwargs)
    except (ValueError, TypeError) as e:
        raise LineError(f"body: {e}") from None
    return line


def _prompts(prompt) -> list[str | list[int]]:
    """body.prompt -> its prompts: a string or a list of token ids is one prompt; a list of strings or
    of token-id lists is several (OpenAI's batched prompts). The schema has checked the types."""
    if prompt is None:
        raise LineError("body.prompt is required: a string, a list of token ids, or a list of either")
    if isinstance(prompt, str):
        if not prompt:
            raise LineError("body.prompt must be a non-empty string")
        return [prompt]
    if not prompt:
        raise LineError("body.prompt must be a non-empty list (of token ids, strings or token-id lists)")
    if isinstance(prompt[0], int):
        return [prompt]                        # one prompt, as token ids
    for i, p in enumerate(prompt):
        if not p:
            raise LineError(f"body.prompt[{i}] must be a non-empty "
                            + ("string" if isinstance(p, str) else "list of token ids"))
    return list(prompt)


def _completion_logprobs(body: Body) -> int | None:
    """Completions: `logprobs` is the number of top alternatives per token (0: the sampled token's only)."""
    val = body.logprobs
    if isinstance(val, bool):
        raise LineError(f"body.logprobs must be an integer for {COMPLETIONS}, got bool")
    return val


def _chat_logprobs(body: Body) -> int | None:
    """Chat: `logprobs: true` asks for them, `top_logprobs` for that many alternatives per token."""
    want, top = body.logprobs, body.top_logprobs
    if want is not None and not isinstance(want, bool):
        raise LineError(f"body.logprobs must be a boolean for {CHAT}, got {type(want).__name__}")
    if not want:
        if top:
            raise LineError("body.top_logprobs needs body.logprobs set to true")
        return None
    return top or 0
