"""OpenAI batch JSONL (what `vllm run-batch` reads and writes): parse request lines, build output lines.

A line that cannot be served becomes a 400 output line naming the problem; it never stops the
batch. Parsing is per line and streamed: the input is never read whole into memory.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from fastdecode.engine.sampling_params import MAX_LOGPROBS, SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "min_tokens", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words")
_TYPES = {"temperature": (int, float), "top_p": (int, float), "top_k": int, "min_p": (int, float),
          "seed": int, "stop_token_ids": list, "ignore_eos": bool, "min_tokens": int, "n": int,
          "max_tokens": int, "max_completion_tokens": int, "presence_penalty": (int, float),
          "frequency_penalty": (int, float), "repetition_penalty": (int, float), "top_logprobs": int,
          "skip_special_tokens": bool, "include_stop_str_in_output": bool, "echo": bool, "prompt_logprobs": int,
          "logit_bias": dict, "allowed_token_ids": list, "bad_words": list}
# Fields that would change the output but are not implemented, and what they ask for: a
# request that uses one gets a 400 instead of an answer that silently ignores it.
_UNSUPPORTED = {"suffix": "suffixes", "use_beam_search": "beam search", "tools": "tool calls",
                "response_format": "structured output", "guided_json": "structured output",
                "guided_regex": "structured output", "guided_choice": "structured output",
                "guided_grammar": "structured output", "structured_outputs": "structured output",
                "logits_processors": "logits processors", "truncate_prompt_tokens": "prompt truncation",
                "chat_template": "custom chat templates", "chat_template_kwargs": "chat template arguments",
                "continue_final_message": "continuing the final message"}
LOGPROB_FLOOR = -9999.0    # what -inf is written as (JSON has no infinity); vLLM does the same


class LineError(ValueError):
    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class BatchLine:
    line_no: int                     # 1-based line number in the input file
    custom_id: str | None
    url: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    params: SamplingParams | None = None
    echo: bool = False               # completions: the prompt goes before the completion (and its logprobs)
    echo_only: bool = False          # ... with max_tokens 0: the prompt alone (one token is generated, unused)
    error: LineError | None = None

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT


def _check_type(body: dict, name: str) -> None:
    if name in body and body[name] is not None:
        val, want = body[name], _TYPES.get(name)
        if want is None:
            return
        ok = isinstance(val, want) and not (want in (int, (int, float)) and isinstance(val, bool))
        if not ok:
            kind = want.__name__ if isinstance(want, type) else "number"
            raise LineError(f"body.{name} must be {kind}, got {type(val).__name__}")


def _reject_unsupported(body: dict, url: str) -> None:
    if url == CHAT and body.get("echo"):    # vLLM's chat echo repeats the last message; not implemented
        raise LineError(f"body.echo: echoing the last message is not supported by fastdecode for {CHAT}",
                        code="unsupported_parameter")
    for name, what in _UNSUPPORTED.items():
        val = body.get(name)
        if val in (None, False, "", [], {}) or (name == "response_format" and val == {"type": "text"}):
            continue
        raise LineError(f"body.{name}: {what} is not supported by fastdecode", code="unsupported_parameter")
    if body.get("add_generation_prompt", True) is not True:
        raise LineError("body.add_generation_prompt: only true (the default) is supported by fastdecode",
                        code="unsupported_parameter")
    best_of, n = body.get("best_of"), body.get("n", 1)
    if best_of is not None and best_of != n:
        raise LineError(f"body.best_of ({best_of!r}) other than n is not supported by fastdecode",
                        code="unsupported_parameter")


def _completion_logprobs(body: dict) -> int | None:
    """Completions: `logprobs` is the number of top alternatives per token (0: the sampled token's only)."""
    val = body.get("logprobs")
    if val is not None and (not isinstance(val, int) or isinstance(val, bool)):
        raise LineError(f"body.logprobs must be an integer for {COMPLETIONS}, got {type(val).__name__}")
    return val


def _chat_logprobs(body: dict) -> int | None:
    """Chat: `logprobs: true` asks for them, `top_logprobs` for that many alternatives per token."""
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise LineError(f"body.logprobs must be a boolean for {CHAT}, got {type(want).__name__}")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise LineError(f"body.top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}")
    if not want:
        if top:
            raise LineError("body.top_logprobs needs body.logprobs set to true")
        return None
    return top or 0


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise LineError("body.messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LineError(f"body.messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):      # OpenAI content parts: keep the text parts
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise LineError(f"body.messages[{i}].content: only text parts are supported")
            content = "".join(texts)
        if not isinstance(content, str):
            raise LineError(f"body.messages[{i}].content must be a string")
        out.append({**m, "content": content})
    return out


def parse_line(line_no: int, text: str) -> BatchLine:
    """One input line -> BatchLine; problems are recorded in .error, never raised."""
    custom_id = None
    try:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise LineError(f"line {line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise LineError(f"line {line_no}: expected a JSON object")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            custom_id = None
            raise LineError(f"line {line_no}: missing or non-string custom_id")
        url = obj.get("url")
        if url not in (COMPLETIONS, CHAT):
            raise LineError(f"unsupported url {url!r}: expected {COMPLETIONS} or {CHAT}", code="invalid_url")
        method = obj.get("method", "POST")
        if method != "POST":
            raise LineError(f"unsupported method {method!r}: expected POST")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise LineError("missing or non-object body")
        for name in list(_TYPES):
            _check_type(body, name)
        _reject_unsupported(body, url)
        line = BatchLine(line_no, custom_id, url)
        if url == CHAT:
            line.messages = _messages(body)
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                line.prompt = prompt           # token ids
            elif isinstance(prompt, str) and prompt:
                line.prompt = prompt
            else:
                raise LineError("body.prompt must be a non-empty string or a list of token ids")
            max_tokens = body.get("max_tokens", 16)   # the completions API's default
            line.echo = bool(body.get("echo"))
            if line.echo and max_tokens == 0:          # scoring a text: vLLM's echo without generation
                line.echo_only, max_tokens = True, 1
        kwargs = {k: body[k] for k in _PARAM_FIELDS if body.get(k) is not None}
        logprobs = _chat_logprobs(body) if url == CHAT else _completion_logprobs(body)
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        prompt_logprobs = body.get("prompt_logprobs")
        if prompt_logprobs is None and line.echo:      # echoed tokens carry logprobs like the generated ones
            prompt_logprobs = logprobs
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
        if body.get("logit_bias"):
            kwargs["logit_bias"] = body["logit_bias"]
        stop = kwargs.get("stop")
        if stop is not None and not isinstance(stop, (str, list)):
            raise LineError("body.stop must be a string or a list of strings")
        try:
            line.params = SamplingParams(max_tokens=max_tokens, **kwargs)
        except (ValueError, TypeError) as e:
            raise LineError(f"body: {e}") from None
        return line
    except LineError as e:
        return BatchLine(line_no, custom_id, error=e)


def read_lines(path: str) -> Iterator[BatchLine]:
    """Stream the input file; blank lines are skipped (their numbers still count)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, text in enumerate(f, start=1):
            if text.strip():
                yield parse_line(line_no, text)


# ---------------------------------------------------------------------------- output lines

def _ids() -> tuple[str, str]:
    return f"batch-{uuid.uuid4().hex}", uuid.uuid4().hex


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(token_ids: list[int], positions: list[dict], top: int) -> dict:
    """OpenAI chat `choice.logprobs`: per token its text, log-probability and bytes, and the `top`
    most likely alternatives."""
    def item(lp) -> dict:
        return {"token": lp.decoded_token, "logprob": _lp(lp.logprob), "bytes": list(lp.decoded_token.encode())}
    content = []
    for tok, pos in zip(token_ids, positions):
        alts = sorted((lp for lp in pos.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
        content.append({**item(pos[tok]), "top_logprobs": [item(lp) for lp in alts]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], positions: list[dict | None], first_text: str = "") -> dict:
    """OpenAI completions `choice.logprobs`: tokens, their log-probabilities, text offsets, and per
    token {text: log-probability} of the sampled token and the top alternatives. A position of None
    (an echoed prompt's first token: nothing comes before it) has text `first_text` and nulls."""
    tokens, token_lps, tops, offsets, off = [], [], [], [], 0
    for tok, pos in zip(token_ids, positions):
        text = first_text if pos is None else pos[tok].decoded_token
        tokens.append(text)
        token_lps.append(None if pos is None else _lp(pos[tok].logprob))
        tops.append(None if pos is None else {lp.decoded_token: _lp(lp.logprob) for lp in pos.values()})
        offsets.append(off)
        off += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(positions: list[dict | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}."""
    return [None if pos is None else
            {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in pos.items()} for pos in positions]


def success_line(custom_id: str, chat: bool, model: str, output, prompt_tokens: int, top_logprobs: int = 0,
                 echo: str | None = None, echo_only: bool = False, first_text: str = "") -> dict:
    """output: a RequestOutput; top_logprobs: alternatives per token its request asked for; echo: the
    prompt's text to put before each completion (completions' `echo`), echo_only: and nothing after it
    (max_tokens 0); first_text: the prompt's first token's text (for echoed logprobs)."""
    line_id, request_id = _ids()
    choices = []
    completion_tokens = 0
    prompt_lps = output.prompt_logprobs
    for c in output.outputs:
        token_ids, positions, text = c.token_ids, c.logprobs, c.text
        if echo_only:
            token_ids, positions, text = [], ([] if positions is not None else None), ""
        completion_tokens += len(token_ids)
        if echo is not None:
            text = echo + text
            if positions is not None:
                token_ids, positions = output.prompt_token_ids + token_ids, prompt_lps + positions
        logprobs = None
        if positions is not None:
            logprobs = (chat_logprobs(token_ids, positions, top_logprobs) if chat
                        else completion_logprobs(token_ids, positions, first_text))
        choice = {"index": c.index, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if echo_only:
            choice["finish_reason"], choice["stop_reason"] = "length", None
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            if prompt_lps is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps)
        choices.append(choice)
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    if chat and prompt_lps is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps)
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_line(custom_id: str | None, code: str, message: str, status: int = 400) -> dict:
    line_id, request_id = _ids()
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id,
                         "body": {"error": {"message": message, "type": "BadRequestError", "code": code}}},
            "error": {"code": code, "message": message}}
