"""SamplingParams with vLLM's field names and defaults, and the outputs `LLM.generate` returns."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_TOP_K = (1 << 31) - 1     # top_k above the vocabulary means all tokens; beyond this it is no token count
INT64 = (-(1 << 63), (1 << 63) - 1)   # a seed's range (vLLM's: a torch.long)
# The sampler computes in float32 (numeric policy, docs/usage.md "Numbers"): a temperature that
# float32 rounds to 0 is greedy, and sampling divides logits less their maximum by it, so a tiny one
# is the greedy limit, never inf/inf; a value float32 cannot hold as a positive normal number where
# it divides or multiplies (repetition_penalty), or that it turns into infinity, is refused.
FLOAT32_TINY, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0     # subtracted once from every token already generated
    frequency_penalty: float = 0.0    # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0   # tokens of the prompt or the output: logit / r if > 0, else * r
    logprobs: int | None = None       # per output token: its log-probability and this many top ones
    prompt_logprobs: int | None = None   # per prompt token after the first: the same, given the tokens before it
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before penalties (OpenAI's)
    allowed_token_ids: list[int] | None = None   # if set, only these tokens may be generated (vLLM's)
    bad_words: list[str] | None = None           # words that may not be generated (vLLM's): a word's last
                                                 # token is banned where the output ends with the rest of it
    detokenize: bool = True                      # False: outputs carry token ids only (text "", as vLLM's)
    spaces_between_special_tokens: bool = True   # vLLM's: a slow tokenizer's added tokens are joined with
                                                 # spaces (a fast tokenizer's text is the same either way)
    truncate_prompt_tokens: int | None = None    # k: only the prompt's last k tokens (left truncation); -1:
                                                 # the last max_model_len (vLLM's)
    # vLLM fields fastdecode refuses (a silently different answer would be worse): any value but these
    best_of: int | None = None                   # None or n
    guided_decoding: object = None               # None
    structured_outputs: object = None            # None
    logits_processors: object = None             # None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):     # OpenAI's JSON has string keys
            self.logit_bias = {_token_key(t): b for t, b in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    def validate(self):
        """Raise ValueError naming the field, as vLLM does for a bad request. Numbers must be
        finite and of their type (no bool for an int, no string for a number); nothing is coerced.
        The engine checks what depends on the model or the job (token ids against the vocabulary,
        logprobs against its max_logprobs)."""
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        if not _int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not _number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            bad("temperature", f"must be a finite number in [0, {FLOAT32_MAX:.4g}] (float32, the sampler's type)")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be an integer in [0, {MAX_TOP_K}] (or -1 for all)")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _int(self.seed) or not INT64[0] <= self.seed <= INT64[1]):
            bad("seed", "must be an integer in [-2**63, 2**63 - 1] (int64)")
        if self.max_tokens is not None and (not _int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not _int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if not all(_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        for name in ("presence_penalty", "frequency_penalty"):
            val = getattr(self, name)
            if not _number(val) or not -2 <= val <= 2:
                bad(name, "must be a number in [-2, 2]")
        if not _number(self.repetition_penalty) or not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            bad("repetition_penalty", f"must be a number > 0 that float32 (the sampler's type) holds: in "
                                      f"[{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}]")
        for name in ("logprobs", "prompt_logprobs"):
            val = getattr(self, name)
            if val is not None and (not _int(val) or val < 0):
                bad(name, "must be an integer >= 0")
        self._validate_token_sets()
        self._validate_vllm_fields()

    def _validate_vllm_fields(self):
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        for name in ("detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True: set detokenize=True to "
                             "use stop (stop_token_ids work either way)")
        k = self.truncate_prompt_tokens
        if k is not None and (not _int(k) or not (k >= 1 or k == -1)):
            bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (the model's context)")
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", f"must be None or n ({self.n}): fastdecode returns every sample it draws (ask "
                "n=best_of and rank the samples by cumulative_logprob, with logprobs=0)")
        for name, what in (("guided_decoding", "guided decoding"), ("structured_outputs", "structured output"),
                           ("logits_processors", "logits processors")):
            if getattr(self, name) is not None:
                bad(name, f"must be None: {what} is not supported by fastdecode")

    def _validate_token_sets(self):
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a map from token id to a number")
            for t, b in self.logit_bias.items():
                if t < 0:
                    bad("logit_bias", f"keys must be token ids (integers >= 0); {t} is not")
                if not _number(b) or not -100 <= b <= 100:
                    bad("logit_bias", f"values must be numbers in [-100, 100]; token {t} has {b!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            bad("bad_words", "must be a list of non-blank strings")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias)

    @property
    def masked(self) -> bool:
        """Some tokens may not be generated: allowed_token_ids or bad_words."""
        return bool(self.allowed_token_ids) or bool(self.bad_words)

    @property
    def greedy(self) -> bool:
        """Decided in float32, the type the sampler divides by the temperature in."""
        return float(np.float32(self.temperature)) == 0.0


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _token_key(key) -> int:
    """A logit_bias key as a token id: ints as they are, decimal strings parsed."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")


@dataclass(slots=True)
class Logprob:
    logprob: float               # natural log, of the model's distribution before any sampling processing
    rank: int                    # 1 = the most likely token
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None    # "stop" | "length"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None   # per output token: {token id: Logprob}, the sampled
                                                       # token and the top `SamplingParams.logprobs`


@dataclass(slots=True)
class RequestMetrics:
    """vLLM's request timings, wall-clock seconds (time.time()), filled as vLLM fills them: arrival
    when the request is added, first scheduled when its prompt is first taken up (time in queue
    between the two), first and last token as tokens come (last token starts at arrival), finished
    when its last sequence ends. vLLM fills the last three only when tracing; so they stay None."""
    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # if asked: None for the first prompt
                                                                     # token, then a dict per token as above
    metrics: RequestMetrics | None = None
