"""A request's generation so far, as a stop leaves it, and its continuation by a later engine.

What a sequence needs to go on exactly as it would have: its generated token ids (the sampler's
state besides them is the request's seed: each token's uniform is a counter-based hash of the
seed, the sample index and the position, engine/sampler.py, so the saved seed and the tokens'
count are the whole RNG state), the log-probabilities already returned for those tokens, and for
a sequence that finished, how. The request's prompt log-probabilities are kept too: a continued
sequence is prefilled as a preempted one is (prompt + all its tokens but the newest, nothing
sampled) and does not compute them again. Penalties, bad words, min_tokens and stop strings are
functions of the tokens, so they follow.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from fastdecode.engine.sequence import Request, Sequence, Status

FINISH_REASONS = ("stop", "length")


@dataclass(slots=True)
class SequenceState:
    sample_index: int
    output_ids: list[int]
    logprobs: list[tuple] = field(default_factory=list)   # as Sequence.logprobs, one per output token
    finish_reason: str | None = None                     # set: the sequence had finished
    stop_reason: int | str | None = None
    text: str = ""                                       # a finished sequence's text cut at its stop string
    kv: object = None                                    # its saved KV (batch/inflight_kv.Record), if a stop kept it


@dataclass(slots=True)
class RequestState:
    seed: int
    prompt_digest: str                                   # of the prompt's token ids: the state is theirs alone
    sequences: list[SequenceState]
    prompt_logprobs: tuple | None = None                 # as Request.prompt_logprobs


def prompt_digest(prompt_ids: list[int]) -> str:
    return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


def capture(req: Request) -> RequestState | None:
    """The request's generation so far; None if no sequence of it has generated a token."""
    seqs = [SequenceState(s.sample_index, list(s.output_ids), list(s.logprobs),
                          s.finish_reason if s.status is Status.FINISHED else None, s.stop_reason, s.text)
            for s in req.sequences if s.output_ids]
    if not seqs:
        return None
    return RequestState(req.seed, prompt_digest(req.prompt_ids), seqs, req.prompt_logprobs)


def check(req: Request, state: RequestState, vocab_size: int, stops=None) -> str | None:
    """Why `state` cannot continue `req` (a new Request with its sequences, nothing generated);
    None if it can. stops: the engine's stop rule (LLMEngine._check_stop), to replay on the
    saved tokens: a saved state must end, or go on, as they do."""
    p = req.params
    if state.prompt_digest != prompt_digest(req.prompt_ids):
        return "the prompt's tokens differ"
    by_index = {s.sample_index: s for s in req.sequences}
    if len({s.sample_index for s in state.sequences}) != len(state.sequences):
        return "a sample is saved twice"
    if p.prompt_logprobs is not None and any(s.sample_index == 0 for s in state.sequences):
        plp = state.prompt_logprobs
        if plp is None or len(plp) != 4 or any(len(col) != len(req.prompt_ids) - 1 for col in plp):
            return "the prompt's log-probabilities are missing or of another length"
    for s in state.sequences:
        seq = by_index.get(s.sample_index)
        if seq is None:
            return f"sample {s.sample_index} is not one of the request's {p.n}"
        n = len(s.output_ids)
        if n == 0 or n > seq.max_tokens or (s.finish_reason is None and n >= seq.max_tokens):
            return f"sample {s.sample_index}: {n} tokens do not fit max_tokens {seq.max_tokens}"
        if s.finish_reason is not None and s.finish_reason not in FINISH_REASONS:
            return f"sample {s.sample_index}: unknown finish reason {s.finish_reason!r}"
        if not all(0 <= t < vocab_size for t in s.output_ids):
            return f"sample {s.sample_index}: a token id outside the vocabulary"
        if len(s.logprobs) != (n if p.logprobs is not None else 0) or \
                any(len(entry[2]) != p.logprobs or len(entry[3]) != p.logprobs for entry in s.logprobs):
            return f"sample {s.sample_index}: {len(s.logprobs)} log-probabilities for {n} tokens"
        if not isinstance(s.stop_reason, (int, str, type(None))) or not isinstance(s.text, str):
            return f"sample {s.sample_index}: a stop reason or text of the wrong type"
        why = _replay(seq, s, stops) if stops is not None else None
        if why is not None:
            return f"sample {s.sample_index}: {why}"
    return None


def _replay(seq: Sequence, s: SequenceState, stops) -> str | None:
    """Why the stop rule does not end the saved tokens as saved: a finished sample where and how
    it finished (not before its last token), an unfinished one not yet; None if it does."""
    def ends(ids: list[int]) -> tuple | None:
        probe = Sequence(seq.seq_id, seq.request, seq.sample_index, seq.max_tokens, output_ids=list(ids))
        return (probe.finish_reason, probe.stop_reason, probe.text) if stops(probe, ids[-1]) else None
    end = ends(s.output_ids)
    if s.finish_reason is None:
        return None if end is None else f"its {len(s.output_ids)} tokens had finished it ({end[0]})"
    if end != (s.finish_reason, s.stop_reason, s.text):
        return f"saved as finished ({s.finish_reason}) where its tokens do not finish it so"
    if len(s.output_ids) > 1 and ends(s.output_ids[:-1]) is not None:
        return "its tokens had finished it before its last"
    return None


def restore(req: Request, state: RequestState) -> None:
    """Put the saved generation into req's sequences (check() found it fits): finished ones are
    FINISHED, the others continue from their tokens."""
    req.seed = state.seed
    if state.prompt_logprobs is not None and req.params.prompt_logprobs is not None:
        req.prompt_logprobs = state.prompt_logprobs
    by_index = {s.sample_index: s for s in req.sequences}
    for s in state.sequences:
        seq = by_index[s.sample_index]
        seq.output_ids = list(s.output_ids)
        seq.logprobs = list(s.logprobs)
        if s.finish_reason is not None:
            seq.status, seq.finish_reason, seq.stop_reason, seq.text = \
                Status.FINISHED, s.finish_reason, s.stop_reason, s.text
        else:
            seq.saved_kv = s.kv
