"""The request line's schema: what a batch line may hold, checked strictly (pydantic), with the
job's limits on what one request may ask for.

Strict means no silent coercion: "5" is not an integer, 5.7 is not a token id, true is not a
number, NaN and Infinity are not numbers. Every problem is reported with the field's path
(`body.messages[1].role`) and becomes that line's 400; the limits (`Limits`, set by `generate`'s
flags) bound what one line can make rank 0 hold or compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from fastdecode.engine.chat import joined_text  # text parts joined as vLLM joins them

Number = Annotated[float, Field(allow_inf_nan=False)]      # strict: an int or a float, finite
TokenId = Annotated[StrictInt, Field(ge=0)]
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request line may ask for (generate's --max-n, --max-logprobs, --max-list-items,
    --max-line-bytes). Lines over a limit get a 400 `request_too_large`, which a rerun with a
    raised limit serves (resume retries it). The engine bounds what a request may pin on rank 0
    (EngineArgs.max_request_mem) and checks max_logprobs again for the Python API."""
    max_n: int = 128                    # samples per prompt (OpenAI's own cap)
    max_logprobs: int = 20              # logprobs, top_logprobs, prompt_logprobs (vLLM's --max-logprobs)
    max_list_items: int = 1024          # entries of stop, stop_token_ids, bad_words, logit_bias, allowed_token_ids;
                                        # prompts of a line
    max_line_bytes: int = 16 << 20      # one input line
    max_inflight_mem: int = 4 << 30     # rank-0 memory all unfinished requests may pin: reading pauses above it


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal[CHAT_ROLES]
    content: Union[StrictStr, list[TextPart]]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else joined_text(self.content)


class Body(BaseModel):
    """Both endpoints' body fields; which apply to which endpoint is checked by jsonl.py."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: StrictStr | None = None
    # one prompt (text, or token ids) or several (OpenAI's batched prompts: strings and token-id lists,
    # mixed as LLM.generate takes them)
    prompt: Union[StrictStr, list[TokenId], list[Union[StrictStr, list[TokenId]]], None] = None
    messages: list[Message] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    best_of: StrictInt | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[StrictStr] | None = None
    logprobs: Union[StrictBool, Annotated[StrictInt, Field(ge=0)], None] = None
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None


class Envelope(BaseModel):
    """The batch line around the body (OpenAI's batch input format)."""
    model_config = ConfigDict(strict=True, extra="allow")
    custom_id: Annotated[StrictStr, Field(min_length=1)]
    method: Literal["POST"] = "POST"
    url: StrictStr
    body: dict[str, Any]


def check_limits(body: Body, limits: Limits) -> str | None:
    """The first limit the body passes, as a message naming the field and the flag; else None."""
    if body.n is not None and body.n > limits.max_n:
        return f"body.n must be at most {limits.max_n} (--max-n), got {body.n}"
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        val = getattr(body, name)
        if isinstance(val, int) and not isinstance(val, bool) and val > limits.max_logprobs:
            return f"body.{name} must be at most {limits.max_logprobs} (--max-logprobs), got {val}"
    for name in ("stop", "stop_token_ids", "bad_words", "logit_bias", "allowed_token_ids"):
        val = getattr(body, name)
        if isinstance(val, (list, dict)) and len(val) > limits.max_list_items:
            return (f"body.{name} must have at most {limits.max_list_items} entries (--max-list-items), "
                    f"got {len(val)}")
    prompt = body.prompt         # a list of prompts; one prompt's token ids are bounded by the context
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > limits.max_list_items:
        return f"body.prompt must have at most {limits.max_list_items} prompts (--max-list-items), got {len(prompt)}"
    return None


_KIND = {"int_type": "an integer", "float_type": "a number", "bool_type": "bool", "string_type": "a string",
         "list_type": "list", "dict_type": "dict", "finite_number": "a finite number",
         "literal_error": "one of {expected}", "greater_than_equal": "a number >= {ge}",
         "greater_than": "a number > {gt}", "string_too_short": "non-empty", "too_short": "non-empty",
         "missing": "present", "model_type": "an object", "model_attributes_type": "an object"}
_UNIONS = {"prompt": "a string, a list of token ids, or a list of strings and token-id lists", "stop": "a string or a list of strings",
           "content": "a string or a list of text parts", "logprobs": "an integer (completions) or bool (chat)"}
_UNION_BRANCHES = {"str", "int", "float", "bool", "none"}


def describe(err: ValidationError, prefix: str) -> str:
    """The first error as `prefix.path must be <what>, got <value>`; a field that takes one of
    several shapes is described as a whole."""
    e = err.errors(include_url=False)[0]
    path, what = prefix, None
    for part in e["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in _UNION_BRANCHES:         # a union's branch: the field as a whole
            what = _UNIONS.get(path.rsplit(".", 1)[-1].split("[")[0])
            if what:
                break
        else:
            path += f".{part}" if part.isidentifier() else f"[{part!r}]"
    if what is None:
        what = _KIND.get(e["type"])
        what = what.format(**e.get("ctx", {})) if what else e["msg"].lower()
    got = "" if e["type"] == "missing" else f", got {_short(e.get('input'))}"
    return f"{path} must be {what}{got}"


def _short(value: Any) -> str:
    text = type(value).__name__ if isinstance(value, (list, dict)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def add_limit_options(parser) -> None:
    """generate's flags for what one request line may ask for (Limits, EngineArgs.max_request_mem)."""
    from fastdecode.engine_options import bytes_arg, positive_int
    d = Limits()
    g = parser.add_argument_group("request limits (a line over one gets a 400 request_too_large)")
    g.add_argument("--max-n", type=positive_int, default=d.max_n, help=f"samples per prompt (default {d.max_n})")
    g.add_argument("--max-logprobs", type=positive_int, default=d.max_logprobs,
                   help=f"logprobs / top_logprobs / prompt_logprobs alternatives (default {d.max_logprobs})")
    g.add_argument("--max-list-items", type=positive_int, default=d.max_list_items,
                   help=f"entries of stop, stop_token_ids, bad_words, logit_bias, allowed_token_ids, and prompts in one line's "
                        f"prompt list (default {d.max_list_items})")
    g.add_argument("--max-line-bytes", type=bytes_arg, default=d.max_line_bytes,
                   help="bytes of one input line (default 16M)")
    g.add_argument("--max-request-mem", type=bytes_arg, default=1 << 30,
                   help="rank-0 memory one request may pin: its tokens, logprobs and output row (default 1G)")
    g.add_argument("--max-inflight-mem", type=bytes_arg, default=d.max_inflight_mem,
                   help="rank-0 memory all unfinished requests may pin; reading the input pauses above it "
                        "(default 4G; at least --max-request-mem)")


def limits_from(args) -> Limits:
    return Limits(max_n=args.max_n, max_logprobs=args.max_logprobs, max_list_items=args.max_list_items,
                  max_line_bytes=args.max_line_bytes,
                  max_inflight_mem=max(args.max_inflight_mem, args.max_request_mem))
