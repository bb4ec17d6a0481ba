"""Requests and the sequences generated for them (n sequences per request)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fastdecode.engine.sampling_params import RequestMetrics, SamplingParams
from fastdecode.sched.status import Status  # noqa: F401  (a sequence's state, named here too)


@dataclass(slots=True)
class Request:
    index: int                       # position in the input (outputs keep input order)
    request_id: str                  # custom_id for batch files
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                        # params.seed, or derived from the engine seed and request_id
    sequences: list["Sequence"] = field(default_factory=list)
    meta: dict = field(default_factory=dict)   # caller's data carried to the output (e.g. chat vs completion)
    arrival_step: int = 0
    prompt_logprobs: tuple | None = None   # if asked, per prompt token after the first:
    #   (logprob [L-1], rank [L-1], top ids [L-1, k], top logprobs [L-1, k])
    bad_words_ids: list[tuple[int, ...]] = field(default_factory=list)   # params.bad_words as token sequences
    pinned_bytes: int = 0            # rank-0 memory it may hold until it finishes (request_checks.request_bytes)
    page_keys: list[int] | None = None   # hash chain over the prompt's whole pages (engine/prefix_cache.py)
    allowed_ids: object = None       # [a] int64 ndarray: params.allowed_token_ids, sorted and distinct, or None
    metrics: RequestMetrics | None = None   # vLLM's timings (set when the engine adds it)

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.sequences)


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int                      # globally unique; the R-workers' KV key
    request: Request
    sample_index: int                # 0..n-1 within the request: the RNG stream
    max_tokens: int                  # resolved (never None)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    worker: int = -1                 # R-worker index (0-based) that holds the KV
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    start_step: int = -1             # step of admission (prefill)
    token_times: list[float] = field(default_factory=list)  # wall time of each output token
    sampling_row: tuple | None = None   # the runner's cache of its sampling parameters
    logprobs: list[tuple] = field(default_factory=list)   # per output token, if asked for:
    #   (logprob, rank, top ids [k], top logprobs [k])
    prefilled: int = 0               # KV tokens a chunked prefill in progress has stored (0 otherwise)
    prefill_to: int = 0              # where this step's prefill chunk ends (set by the scheduler)
    saved_kv: object = None          # a stop's save of its KV (batch/inflight_kv.Record): reloaded, not recomputed

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are stored: the prompt and every output token but the newest."""
        return self.prompt_len + max(len(self.output_ids) - 1, 0)

    @property
    def total_len_bound(self) -> int:
        """Most KV tokens this sequence can ever hold."""
        return self.prompt_len + self.max_tokens

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]
