"""SamplingParams with vLLM's field names and defaults, and the outputs `LLM.generate` returns."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20         # most top alternatives per token (vLLM's max_logprobs default, OpenAI's top_logprobs)


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):     # OpenAI's JSON has string keys
            self.logit_bias = {_token_key(t): b for t, b in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    def validate(self):
        """Raise ValueError naming the field, as vLLM does for a bad request."""
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (or -1 for all)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        for name in ("presence_penalty", "frequency_penalty"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or isinstance(val, bool) or not -2 <= val <= 2:
                bad(name, "must be a number in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or isinstance(self.repetition_penalty, bool) \
                or not 0 < self.repetition_penalty < float("inf"):
            bad("repetition_penalty", "must be a number > 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a map from token id to a number")
            for t, b in self.logit_bias.items():
                if t < 0:
                    bad("logit_bias", f"keys must be token ids (integers >= 0); {t} is not")
                if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100:
                    bad("logit_bias", f"values must be numbers in [-100, 100]; token {t} has {b!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)):
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
        return self.temperature == 0


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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # if asked: None for the first prompt
                                                                     # token, then a dict per token as above
