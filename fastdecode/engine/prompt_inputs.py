"""The prompt shapes `LLM.generate` takes, as vLLM's does: a string, a TextPrompt
`{"prompt": str}`, a TokensPrompt `{"prompt_token_ids": [int, ...]}`, or a list of token ids;
one of them or a list of them, mixed. Each becomes (text, None) or (None, token ids); a shape
outside these is a TypeError or ValueError naming its index and what is accepted. Token ids are
checked against the vocabulary by the engine (request_checks.py), which knows it.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

from fastdecode.engine.sampling_params import SamplingParams

ACCEPTED = ("a string, {'prompt': str}, {'prompt_token_ids': [int, ...]} or a list of token ids")
# keys of vLLM's TextPrompt / TokensPrompt that would change the answer and are not implemented
UNSUPPORTED_KEYS = {"prompt_embeds": "prompt embeddings", "multi_modal_data": "multi-modal inputs",
                    "mm_processor_kwargs": "multi-modal inputs", "token_type_ids": "token type ids",
                    "multi_modal_uuids": "multi-modal inputs"}
IGNORED_KEYS = {"cache_salt"}       # isolates vLLM's prefix cache; fastdecode has none to isolate


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def token_ids(value, where: str) -> list[int]:
    """A non-empty list (or tuple) of integer token ids, as plain ints."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where} must be a list of token ids (integers), got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where} is empty: a prompt needs at least one token id")
    bad = next((i for i, t in enumerate(value) if not _is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"{where}[{bad}] must be an integer token id, got {value[bad]!r}")
    return [int(t) for t in value]


def _from_dict(prompt: dict, where: str) -> tuple[str | None, list[int] | None]:
    for key in prompt:
        if key in UNSUPPORTED_KEYS:
            raise ValueError(f"{where}[{key!r}]: {UNSUPPORTED_KEYS[key]} are not supported by fastdecode")
        if key not in ("prompt", "prompt_token_ids") and key not in IGNORED_KEYS:
            raise ValueError(f"{where} has the unknown key {key!r}: a prompt dict is {{'prompt': str}} (vLLM's "
                             f"TextPrompt) or {{'prompt_token_ids': [int, ...]}} (TokensPrompt)")
    if "prompt" in prompt and "prompt_token_ids" in prompt:
        raise ValueError(f"{where} has both 'prompt' and 'prompt_token_ids': give one")
    if "prompt_token_ids" in prompt:
        return None, token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
    if "prompt" not in prompt:
        raise ValueError(f"{where} is a dict without 'prompt' or 'prompt_token_ids'")
    if not isinstance(prompt["prompt"], str):
        raise TypeError(f"{where}['prompt'] must be a string, got {type(prompt['prompt']).__name__}")
    return prompt["prompt"], None


def one_prompt(prompt, where: str) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids) of one prompt in any accepted shape."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        return _from_dict(prompt, where)
    if isinstance(prompt, (list, tuple)):
        return None, token_ids(prompt, where)
    raise TypeError(f"{where} must be {ACCEPTED}, got {type(prompt).__name__}")


def parse_prompts(prompts) -> list[tuple[str | None, list[int] | None]]:
    """generate's `prompts`, one or a list, -> per prompt (text, None) or (None, token ids)."""
    if isinstance(prompts, (str, dict)):
        return [one_prompt(prompts, "prompts")]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be {ACCEPTED}, or a list of these; got {type(prompts).__name__}")
    if prompts and _is_token_id(prompts[0]):               # one prompt given as token ids
        return [(None, token_ids(prompts, "prompts"))]
    return [one_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    """One SamplingParams for all prompts (None: the defaults), or a list of one per prompt."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, one per prompt; got "
                        f"{type(sampling_params).__name__}")
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
    bad = next((i for i, p in enumerate(params) if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params[{bad}] must be a SamplingParams, got {type(params[bad]).__name__}")
    return params
