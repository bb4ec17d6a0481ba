"""Per-step statistics of the decode loop, and the run summary (`--stats-json`)."""
from __future__ import annotations

import json
import os

import numpy as np


class StepRecorder:
    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.steps: list[dict] = []

    def record(self, step: int, active: int, running, runner, stats, prefill_s: float, step_s: float,
               decode: bool) -> None:
        kv_tokens = [0] * self.num_workers
        for s in running:
            kv_tokens[s.worker] += s.kv_len
        row = {"step": step, "active": active, "kv_tokens": kv_tokens, "prefill_s": round(prefill_s, 6),
               "step_s": round(step_s, 6)}
        if decode:
            row["s_time_s"] = round(runner.last_s_time, 6)
            row["r_wait_s"] = round(runner.last_r_wait, 6)
        if stats is not None:
            row["r_attend_s"] = [round(x, 6) for x in stats.attend_s]
            row["r_busy_s"] = [round(x, 6) for x in stats.busy_s]
            row["r_time_max_s"] = round(max(stats.attend_s), 6)
            row["kv_bytes"] = stats.kv_bytes
        self.steps.append(row)

    def summary(self, wall_s: float, output_tokens: int, prompt_tokens: int, token_gaps: np.ndarray) -> dict:
        dec = [r for r in self.steps if "s_time_s" in r]
        s_busy = sum(r["s_time_s"] for r in dec)
        r_busy = sum(r.get("r_time_max_s", 0.0) for r in dec)
        decode_s = sum(r["step_s"] - r["prefill_s"] for r in dec)
        out = {
            "wall_s": round(wall_s, 4),
            "steps": len(self.steps),
            "decode_steps": len(dec),
            "output_tokens": output_tokens,
            "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": round(output_tokens / wall_s, 3) if wall_s else None,
            "total_tokens_per_s": round((output_tokens + prompt_tokens) / wall_s, 3) if wall_s else None,
            "decode_s": round(decode_s, 4),
            # fraction of decode time each side sat idle (the pipeline's bubbles)
            "s_bubble_fraction": round(1 - s_busy / decode_s, 4) if decode_s else None,
            "r_bubble_fraction": round(1 - r_busy / decode_s, 4) if decode_s else None,
        }
        if token_gaps.size:
            out["token_latency_p50_s"] = round(float(np.percentile(token_gaps, 50)), 6)
            out["token_latency_p99_s"] = round(float(np.percentile(token_gaps, 99)), 6)
        if dec and any("r_time_max_s" in r for r in dec):
            r_times = np.array([r["r_time_max_s"] for r in dec if "r_time_max_s" in r])
            out["r_time_cv"] = round(float(r_times.std() / r_times.mean()), 4) if r_times.mean() > 0 else None
        return out

    def write(self, path: str, summary: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"summary": summary, "steps": self.steps}, f)
        os.replace(tmp, path)


class Reservoir:
    """A uniform sample of at most `size` values from a stream (bounded memory for percentiles)."""

    def __init__(self, size: int = 1 << 20, seed: int = 0):
        self.size, self.seen = size, 0
        self.buf = np.empty(size, dtype=np.float64)
        self.rng = np.random.default_rng(seed)

    def add(self, values) -> None:
        v = np.asarray(values, dtype=np.float64).ravel()
        room = max(min(self.size - self.seen, v.size), 0)
        self.buf[self.seen:self.seen + room] = v[:room]
        rest = v[room:]
        if rest.size:   # reservoir sampling: item number t replaces a random slot with p = size / t
            t = self.seen + room + np.arange(rest.size)
            j = (self.rng.random(rest.size) * (t + 1)).astype(np.int64)
            keep = j < self.size
            self.buf[j[keep]] = rest[keep]
        self.seen += v.size

    def values(self) -> np.ndarray:
        return self.buf[: min(self.seen, self.size)]
