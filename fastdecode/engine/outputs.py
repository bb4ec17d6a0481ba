"""A finished request as vLLM's RequestOutput: each sample's text (unless detokenize is off),
token ids, finish and stop reasons, per-position log-probabilities as vLLM's dicts, and the
request's metrics."""
from __future__ import annotations

import dataclasses

from fastdecode.engine.sampling_params import CompletionOutput, Logprob, RequestOutput
from fastdecode.engine.sequence import Request


def request_output(req: Request, tokenizer) -> RequestOutput:
    """vLLM's RequestOutput; with detokenize=False no text (empty, and logprobs without decoded tokens)."""
    outs = []
    p = req.params
    for s in req.sequences:
        if not p.detokenize:
            text = ""
        elif isinstance(s.stop_reason, str):
            text = s.text
        else:
            text = tokenizer.decode(s.output_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
        out = CompletionOutput(s.sample_index, text, list(s.output_ids), s.finish_reason, s.stop_reason)
        if p.logprobs is not None:
            out.logprobs = [position_logprobs(tokenizer, tok, entry, p.detokenize)
                            for tok, entry in zip(s.output_ids, s.logprobs)]
            out.cumulative_logprob = float(sum(entry[0] for entry in s.logprobs))
        outs.append(out)
    result = RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs,
                           metrics=dataclasses.replace(req.metrics) if req.metrics else None)
    if req.prompt_logprobs is not None:
        result.prompt_logprobs = [None] + [position_logprobs(tokenizer, tok, entry, p.detokenize)
                                           for tok, entry in zip(req.prompt_ids[1:], zip(*req.prompt_logprobs))]
    return result


def position_logprobs(tokenizer, token: int, entry: tuple, detokenize: bool = True) -> dict[int, Logprob]:
    """vLLM's per-position dict: the sampled token, then the top ones by rank (one entry if it is among them)."""
    chosen, rank, top_ids, top = entry
    text = tokenizer.token_text if detokenize else (lambda t: None)
    found = {token: Logprob(float(chosen), int(rank), text(token))}
    for r, (t, lp) in enumerate(zip(top_ids.tolist(), top.tolist()), start=1):
        if t not in found:
            found[t] = Logprob(lp, r, text(t))
    return found
