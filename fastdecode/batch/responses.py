"""Output rows in the OpenAI batch format (what `vllm run-batch` writes): a completion or chat
response per request, or an error row, with log-probabilities in OpenAI's and vLLM's shapes."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

LOGPROB_FLOOR = -9999.0    # what -inf is written as (JSON has no infinity); vLLM does the same


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


@dataclass(slots=True)
class Answer:
    """One prompt's part of a row: its RequestOutput, its prompt's token count, the prompt's text
    to put before each completion (completions' `echo`) and its first token's text (for echoed
    logprobs)."""
    output: object
    prompt_tokens: int
    echo: str | None = None
    first_text: str = ""


def _choices(answer: Answer, first_index: int, chat: bool, top_logprobs: int, echo_only: bool) -> tuple[list, int]:
    """The choices of one prompt, numbered from first_index; and its completion tokens."""
    output, echo = answer.output, answer.echo
    choices, completion_tokens = [], 0
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
                        else completion_logprobs(token_ids, positions, answer.first_text))
        choice = {"index": first_index + c.index, "logprobs": logprobs, "finish_reason": c.finish_reason,
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
    return choices, completion_tokens


def success_line(custom_id: str, chat: bool, model: str, answers: list[Answer], top_logprobs: int = 0,
                 echo_only: bool = False) -> dict:
    """answers: one per prompt (completions take a list of prompts: prompt i's n choices are numbered
    i*n .. i*n+n-1, as OpenAI's endpoint does, and usage sums over the prompts); top_logprobs:
    alternatives per token the request asked for; echo_only: the echoed prompt alone (max_tokens 0)."""
    line_id, request_id = _ids()
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for answer in answers:
        some, generated = _choices(answer, len(choices), chat, top_logprobs, echo_only)
        choices += some
        prompt_tokens += answer.prompt_tokens
        completion_tokens += generated
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    if chat and answers[0].output.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(answers[0].output.prompt_logprobs)
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError"}     # OpenAI's and vLLM's names


def error_line(custom_id: str | None, code: str, message: str, status: int = 400) -> dict:
    line_id, request_id = _ids()
    error = {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "code": code}
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": {"error": error}},
            "error": {"code": code, "message": message}}
