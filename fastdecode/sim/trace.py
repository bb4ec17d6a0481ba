"""The requests a simulation serves: read from a trace file, or drawn from length distributions.

A trace is JSONL (one object per line) or JSON (a list of objects, or {"requests": [...]}); each
object has
    prompt_len   prompt tokens (>= 1)
    output_len   tokens the request really generates (EOS or max_tokens ended it; >= 1)
    max_tokens   its bound, what admission and reservation see (optional: output_len; >= output_len)
    arrival_s    seconds after the job starts at which it joins the queue (optional: 0)
`prompt_tokens` / `completion_tokens` (the names of a response's usage) are taken for the first two.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

ALIASES = {"prompt_len": ("prompt_len", "prompt_tokens"), "output_len": ("output_len", "completion_tokens")}
DISTRIBUTIONS = ("N (fixed)", "uniform:LO:HI", "lognormal:MEAN:SIGMA")


class TraceError(ValueError):
    pass


@dataclass(slots=True)
class Trace:
    prompt_len: np.ndarray      # [n] int64 tokens
    output_len: np.ndarray      # [n] int64 tokens generated (1..max_tokens)
    max_tokens: np.ndarray      # [n] int64 the bound admission sees
    arrival_s: np.ndarray       # [n] float64 seconds

    def __len__(self) -> int:
        return int(self.prompt_len.size)

    def describe(self) -> dict:
        return {"requests": len(self), "prompt_tokens": int(self.prompt_len.sum()),
                "output_tokens": int(self.output_len.sum()),
                "prompt_len_mean": round(float(self.prompt_len.mean()), 2),
                "output_len_mean": round(float(self.output_len.mean()), 2),
                "stopped_early": int((self.output_len < self.max_tokens).sum()),
                "last_arrival_s": round(float(self.arrival_s.max()), 4)}


def _int_field(rec: dict, key: str, where: str, lo: int) -> int | None:
    names = ALIASES.get(key, (key,))
    name = next((n for n in names if n in rec), None)
    if name is None:
        return None
    v = rec[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < lo:
        raise TraceError(f"{where}: {name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _record(rec, where: str) -> tuple[int, int, int, float]:
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected an object with prompt_len and output_len, got {type(rec).__name__}")
    prompt, out = _int_field(rec, "prompt_len", where, 1), _int_field(rec, "output_len", where, 1)
    for key, v in (("prompt_len", prompt), ("output_len", out)):
        if v is None:
            raise TraceError(f"{where}: missing {key} (or {ALIASES[key][1]})")
    bound = _int_field(rec, "max_tokens", where, 1)
    if bound is not None and bound < out:
        raise TraceError(f"{where}: max_tokens {bound} is below output_len {out}")
    arrival = rec.get("arrival_s", 0.0)
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) \
            or arrival < 0:
        raise TraceError(f"{where}: arrival_s must be a number >= 0, got {arrival!r}")
    return prompt, out, out if bound is None else bound, float(arrival)


def _records(path: str, text: str) -> list[tuple[dict, str]]:
    """(object, where) pairs: a JSON document, else JSONL."""
    stripped = text.lstrip()
    doc = None
    if stripped.startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            if stripped.startswith("["):
                raise TraceError(f"{path}: not valid JSON ({e})") from None
    if isinstance(doc, dict) and "requests" in doc:
        doc = doc["requests"]
        if not isinstance(doc, list):
            raise TraceError(f"{path}: 'requests' must be a list")
    if isinstance(doc, list):
        return [(rec, f"{path}: request {i}") for i, rec in enumerate(doc)]
    out = []
    for no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((json.loads(line), f"{path}:{no}"))
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{no}: not valid JSON ({e.msg})") from None
    return out


def load_trace(path: str) -> Trace:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    rows = [_record(rec, where) for rec, where in _records(path, text)]
    if not rows:
        raise TraceError(f"{path}: no requests")
    cols = list(zip(*rows))
    return Trace(np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.int64),
                 np.array(cols[3], np.float64))


def draw_lengths(spec: str, n: int, rng: np.random.Generator, flag: str) -> np.ndarray:
    """[n] int64 lengths >= 1 from a distribution spec (DISTRIBUTIONS)."""
    parts = spec.split(":")
    try:
        nums = [float(x) for x in parts[1:]] if len(parts) > 1 else [float(parts[0])]
    except ValueError:
        raise TraceError(f"{flag}: cannot read {spec!r}; expected one of {', '.join(DISTRIBUTIONS)}") from None
    kind = parts[0] if len(parts) > 1 else "fixed"
    if kind == "fixed" and len(nums) == 1 and nums[0] >= 1 and nums[0] == int(nums[0]):
        return np.full(n, int(nums[0]), np.int64)
    if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
        return rng.integers(int(nums[0]), int(nums[1]) + 1, n).astype(np.int64)
    if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
        mean, sigma = nums       # mean of the lengths: mu = log(mean) - sigma^2 / 2
        x = rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)
        return np.maximum(np.rint(x), 1).astype(np.int64)
    raise TraceError(f"{flag}: {spec!r} is not one of {', '.join(DISTRIBUTIONS)} (lengths >= 1, LO <= HI)")


def synthetic_trace(requests: int, prompt: str, output: str, max_tokens: int | None = None,
                    rate: float | None = None, seed: int = 0) -> Trace:
    """`requests` requests with lengths drawn from the specs; output lengths are capped at
    max_tokens (the bound admission sees; default each request's own length); arrivals Poisson at
    `rate` requests/s (default: all at 0)."""
    if requests < 1:
        raise TraceError(f"--requests must be >= 1 (got {requests})")
    rng = np.random.default_rng(seed)
    p = draw_lengths(prompt, requests, rng, "--prompt-len")
    o = draw_lengths(output, requests, rng, "--output-len")
    bound = o.copy() if max_tokens is None else np.full(requests, max_tokens, np.int64)
    o = np.minimum(o, bound)
    arrival = np.zeros(requests) if not rate else np.cumsum(rng.exponential(1.0 / rate, requests))
    return Trace(p, o, bound, arrival)
