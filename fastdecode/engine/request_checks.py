"""What the engine checks of a request before it queues it: what depends on the model (token
ids against the vocabulary, the context length, masks that leave something to generate) and on
the job (--max-logprobs, the rank-0 memory one request may pin). A request that fails gets a
RequestError naming the field; it is never admitted, so nothing it asks for is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdecode.engine.sampling_params import SamplingParams
from fastdecode.engine.token_masks import bad_word_sequences

# Rank-0 bytes a request pins over its life, per unit: the tracemalloc peak of a request's whole
# life (add_request, its steps, output_of, the output row as JSON) on a one-layer SmolLM2 shape,
# over prompt 64..4000, max_tokens 256..1024, logprobs/prompt_logprobs 0..20, rounded up. The
# prompt log-probabilities' LM-head block (bounded, whatever the prompt) is not per request.
BYTES_PROMPT_TOKEN = 24           # measured 19
BYTES_OUTPUT_TOKEN = 128          # measured 116 per generated token of every sample
BYTES_LOGPROB = 1500              # measured 1,380-1,430 per generated token with logprobs=0
BYTES_LOGPROB_ALT = 150           # measured 125 per alternative per generated token
BYTES_PROMPT_LOGPROB = 500        # per prompt position with prompt_logprobs (under the block at k <= 5)
BYTES_PROMPT_LOGPROB_ALT = 450    # measured 9.4 KB per position at k = 20
# What the request's own lists pin (tracemalloc of a parsed line's SamplingParams, 10^4..10^5 entries):
BYTES_LIST_ITEM = 64              # a token id of allowed_token_ids or stop_token_ids: measured 40, + 8 its array
BYTES_MAP_ITEM = 200              # a logit_bias entry: measured 110-170
BYTES_STRING = 64                 # a stop or bad_words string, besides its length


class RequestError(ValueError):
    """A request that cannot be served (bad parameters, too long): reported per request, never fatal."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Checked:
    max_tokens: int                        # the request's bound (the rest of the context if it set none)
    bad_words_ids: list[tuple[int, ...]]   # params.bad_words as token sequences
    pinned_bytes: int                      # request_bytes of it
    allowed_ids: np.ndarray | None = None  # [a] int64: params.allowed_token_ids, sorted and distinct (made once,
                                           # read by every step's mask)


def request_bytes(prompt_len: int, max_tokens: int, params: SamplingParams) -> int:
    """Rank-0 memory a request can pin until it finishes: its prompt, every sample's tokens and
    the log-probabilities it asked for, and the output row built from them."""
    out = params.n * max_tokens * (BYTES_OUTPUT_TOKEN + (BYTES_LOGPROB + BYTES_LOGPROB_ALT * params.logprobs
                                                         if params.logprobs is not None else 0))
    prompt = prompt_len * (BYTES_PROMPT_TOKEN + (BYTES_PROMPT_LOGPROB + BYTES_PROMPT_LOGPROB_ALT * params.prompt_logprobs
                                                 if params.prompt_logprobs is not None else 0))
    return out + prompt + list_bytes(params)


def list_bytes(params: SamplingParams) -> int:
    """What the request's own lists hold: token-id lists, logit_bias, stop and bad_words strings."""
    ids = len(params.allowed_token_ids or ()) + len(params.stop_token_ids or ())
    texts = sum(BYTES_STRING + len(t) for t in (*(params.stop or ()), *(params.bad_words or ())))
    return ids * BYTES_LIST_ITEM + len(params.logit_bias or ()) * BYTES_MAP_ITEM + texts


class RequestChecks:
    def __init__(self, vocab_size: int, max_model_len: int, eos_ids: frozenset[int], encode_text,
                 max_logprobs: int, max_request_mem: int):
        self.vocab, self.max_model_len, self.eos_ids = vocab_size, max_model_len, eos_ids
        self.encode_text = encode_text
        self.max_logprobs, self.max_request_mem = max_logprobs, max_request_mem

    def check(self, prompt_ids: list[int], params: SamplingParams) -> Checked:
        n_prompt, limit = len(prompt_ids), self.max_model_len
        if n_prompt == 0:
            raise RequestError("the prompt is empty (no tokens)")
        self._check_ids(prompt_ids, params)
        bad_words_ids, allowed_ids = self._check_masks(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n_prompt
        if n_prompt + max_tokens > limit or max_tokens < 1:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max(max_tokens, 1)} tokens ({n_prompt} in the messages, "
                f"{max(max_tokens, 1)} in the completion). Please reduce the length of the messages or completion.",
                code="context_length_exceeded")
        return Checked(max_tokens, bad_words_ids, self._check_size(n_prompt, max_tokens, params), allowed_ids)

    def _check_ids(self, prompt_ids: list[int], params: SamplingParams) -> None:
        outside = [t for t in prompt_ids if not 0 <= t < self.vocab]
        if outside:
            shown = ", ".join(map(str, list(dict.fromkeys(outside))[:5])) + (", ..." if len(set(outside)) > 5 else "")
            raise RequestError(f"prompt token ids {shown} are not in the model's vocabulary [0, {self.vocab})")
        if params.logit_bias and max(params.logit_bias) >= self.vocab:
            raise RequestError(f"logit_bias token id {max(params.logit_bias)} is not in the model's vocabulary "
                               f"[0, {self.vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab:
            raise RequestError(f"stop_token_ids: token id {max(params.stop_token_ids)} is not in the model's "
                               f"vocabulary [0, {self.vocab})")

    def _check_size(self, n_prompt: int, max_tokens: int, params: SamplingParams) -> int:
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise RequestError(f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {k}",
                                   code="request_too_large")
        need = request_bytes(n_prompt, max_tokens, params)
        if need > self.max_request_mem:
            raise RequestError(f"the request would hold about {need / 2**20:,.0f} MiB on rank 0 (n={params.n} x "
                               f"{max_tokens} tokens, prompt {n_prompt}, logprobs {params.logprobs}, prompt_logprobs "
                               f"{params.prompt_logprobs}), more than --max-request-mem "
                               f"{self.max_request_mem / 2**20:,.0f} MiB", code="request_too_large")
        return need

    def _check_masks(self, params: SamplingParams) -> tuple[list[tuple[int, ...]], np.ndarray | None]:
        """allowed_token_ids and bad_words against the model; -> (bad_words as token sequences, the
        allowed ids as a sorted array). A request whose masks leave no token to generate is refused
        here rather than sampled from nothing."""
        given = params.allowed_token_ids or ()
        allowed_ids = np.unique(np.fromiter(given, np.int64, len(given))) if given else None      # [a]
        allowed = set(allowed_ids.tolist()) if allowed_ids is not None else set()
        if allowed and max(allowed) >= self.vocab:
            raise RequestError(f"allowed_token_ids: token id {max(allowed)} is not in the model's vocabulary "
                               f"[0, {self.vocab})")
        bad_ids = []
        if params.bad_words:
            try:
                bad_ids = bad_word_sequences(self.encode_text, params.bad_words)
            except ValueError as e:
                raise RequestError(f"bad_words: {e}") from None
        if allowed:
            allowed -= {ids[0] for ids in bad_ids if len(ids) == 1}
            if not allowed:
                raise RequestError("bad_words ban every token in allowed_token_ids")
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            if params.min_tokens > 0 and allowed <= ends:
                raise RequestError(f"min_tokens is {params.min_tokens} but every token in allowed_token_ids "
                                   f"ends the sequence (EOS or stop_token_ids)")
        return bad_ids, allowed_ids
