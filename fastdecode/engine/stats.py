"""Per-step statistics of the decode loop, and the run summary (`--stats-json`)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

MAX_ROWS = 65_536     # per-step rows kept for --stats-json (about 40 MiB); see StepRecorder


@dataclass(slots=True)
class PrefillPhases:
    """Where one prefill's time went (seconds on rank 0's host clock; on a CUDA S-worker the
    compute phases are launch time, the device's work shows up where the host next waits)."""
    tokens: int = 0            # prompt tokens computed (a preempted sequence's recomputed ones too)
    wall_s: float = 0.0        # the whole prefill
    s_compute_s: float = 0.0   # dense S-part work: embedding, projections, MLPs, LM head, sampling
    s_attention_s: float = 0.0  # causal attention within the prompts, on the S-worker
    pack_s: float = 0.0        # K/V into wire buffers (MPI) or the store's input arrays (local)
    wait_s: float = 0.0        # blocked on the R-part: wire buffers in flight, the last sends/appends
    append_s: float = 0.0      # local mode: the store's appends (on a helper thread when pipelined)
    mixed: bool = False        # a chunked-prefill step: decode rows shared the dense layers (wall_s and
                               # s_compute_s are the whole step's, which decode_s counts too)

    def row(self, r_append_s: list[float]) -> dict:
        """The step row's `prefill` entry; r_append_s: each R-worker's append seconds."""
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        del out["append_s"]
        out["r_append_s"] = [round(x, 6) for x in r_append_s]
        return out


PREFILL_SUMS = ("wall_s", "s_compute_s", "s_attention_s", "pack_s", "wait_s")


class StepRecorder:
    """Per-step rows for --stats-json, and running totals for the summary and the report.

    A job of millions of requests runs millions of steps: the rows kept are bounded. When
    MAX_ROWS are held every other one is dropped and from then on only every `stride`-th step is
    recorded, so the rows stay an evenly spaced sample of the whole run (each names its step).
    Totals, peaks and per-worker load are kept over every step."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.steps: list[dict] = []
        self.stride = 1
        self.num_steps = self.num_decode = 0
        self.s_busy = self.r_busy = self.decode_s = 0.0
        self.r_time_n, self.r_time_sum, self.r_time_sq = 0, 0.0, 0.0   # r_time_max_s over decode steps
        n = num_workers
        self.kv_tokens_peak, self.kv_tokens_sum = [0] * n, [0] * n    # sum over decode steps
        self.kv_bytes_peak = [0] * n
        self.kv_saved_bytes_peak = [0] * n    # shared prefix pages: bytes held once instead of per sequence
        self.attend_s, self.busy_s = [0.0] * n, [0.0] * n
        self.origin: float | None = None      # perf_counter at the start of the first step (rows' t_s)
        self.prefills = self.prefill_tokens = self.mixed_steps = 0
        self.prefill_sums = dict.fromkeys(PREFILL_SUMS, 0.0)
        self.r_append_s = [0.0] * n

    def _accumulate(self, row: dict) -> None:
        self.num_steps += 1
        kv = row["kv_tokens"]
        decode = "s_time_s" in row
        for w in range(self.num_workers):
            self.kv_tokens_peak[w] = max(self.kv_tokens_peak[w], kv[w])
            if decode:
                self.kv_tokens_sum[w] += kv[w]
        for w, b in enumerate(row.get("kv_bytes", ())):
            self.kv_bytes_peak[w] = max(self.kv_bytes_peak[w], int(b))
        for w, b in enumerate(row.get("kv_saved_bytes", ())):
            self.kv_saved_bytes_peak[w] = max(self.kv_saved_bytes_peak[w], int(b))
        for w, t in enumerate(row.get("r_attend_s", ())):
            self.attend_s[w] += t
        for w, t in enumerate(row.get("r_busy_s", ())):
            self.busy_s[w] += t
        pf = row.get("prefill")
        if pf is not None:
            self.prefills += 1
            self.mixed_steps += bool(pf["mixed"])
            self.prefill_tokens += pf["tokens"]
            for k in PREFILL_SUMS:
                self.prefill_sums[k] += pf[k]
            for w, t in enumerate(pf["r_append_s"]):
                self.r_append_s[w] += t
        if decode:
            self.num_decode += 1
            self.s_busy += row["s_time_s"]
            self.decode_s += row["step_s"] - row["prefill_s"]
            r = row.get("r_time_max_s")
            if r is not None:
                self.r_busy += r
                self.r_time_n += 1
                self.r_time_sum += r
                self.r_time_sq += r * r

    def _keep(self, row: dict) -> None:
        if (self.num_steps - 1) % self.stride:
            return
        self.steps.append(row)
        if len(self.steps) >= MAX_ROWS:
            del self.steps[1::2]
            self.stride *= 2

    def record(self, step: int, active: int, running, runner, stats, prefill_s: float, step_s: float,
               decode: bool, tokens: int = 0, prefill: PrefillPhases | None = None) -> None:
        """One step: `active` sequences decoded, `tokens` sampled (decode and prefill's first tokens),
        `prefill` the phases of the step's prefill if it had one."""
        now = time.perf_counter()
        if self.origin is None:
            self.origin = now - step_s
        kv_tokens = [0] * self.num_workers
        for s in running:
            kv_tokens[s.worker] += s.kv_len
        row = {"step": step, "t_s": round(now - self.origin, 6), "active": active, "tokens": tokens,
               "kv_tokens": kv_tokens, "prefill_s": round(prefill_s, 6), "step_s": round(step_s, 6)}
        if decode:
            row["s_time_s"] = round(runner.last_s_time, 6)
            row["r_wait_s"] = round(runner.last_r_wait, 6)
        if stats is not None:
            row["r_attend_s"] = [round(x, 6) for x in stats.attend_s]
            row["r_busy_s"] = [round(x, 6) for x in stats.busy_s]
            row["r_time_max_s"] = round(max(stats.attend_s), 6)
            row["kv_bytes"] = stats.kv_bytes
            saved = getattr(stats, "kv_saved_bytes", None)     # (stats from before sharing lack it)
            if saved and any(saved):
                row["kv_saved_bytes"] = saved
        if prefill is not None:      # R-workers report appends with the step's decode stats; local mode here
            appended = list(stats.append_s) if stats is not None and stats.append_s else \
                [prefill.append_s] + [0.0] * (self.num_workers - 1)
            row["prefill"] = prefill.row(appended)
        self._accumulate(row)
        self._keep(row)

    def per_worker(self) -> list[dict]:
        """Per R-worker over every step: KV held (tokens: peak, mean over decode steps; bytes:
        peak) and kernel / message-handling seconds."""
        d = self.num_decode
        return [{"kv_tokens_peak": self.kv_tokens_peak[w],
                 "kv_tokens_mean": round(self.kv_tokens_sum[w] / d, 1) if d else 0.0,
                 "kv_bytes_peak": self.kv_bytes_peak[w],
                 "attend_s": round(self.attend_s[w], 4), "busy_s": round(self.busy_s[w], 4)}
                for w in range(self.num_workers)]

    def summary(self, wall_s: float, output_tokens: int, prompt_tokens: int, token_gaps: np.ndarray) -> dict:
        s_busy, r_busy, decode_s = self.s_busy, self.r_busy, self.decode_s
        out = {
            "wall_s": round(wall_s, 4),
            "steps": self.num_steps,
            "decode_steps": self.num_decode,
            "output_tokens": output_tokens,
            "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": round(output_tokens / wall_s, 3) if wall_s else None,
            "total_tokens_per_s": round((output_tokens + prompt_tokens) / wall_s, 3) if wall_s else None,
            "decode_s": round(decode_s, 4),
            # fraction of decode time each side sat idle (the pipeline's bubbles)
            "s_bubble_fraction": round(1 - s_busy / decode_s, 4) if decode_s else None,
            "r_bubble_fraction": round(1 - r_busy / decode_s, 4) if decode_s else None,
            # the side busier over the decode steps bounds them (the S-part, or the slowest R-worker)
            "bound": ("S" if s_busy >= r_busy else "R") if decode_s else None,
        }
        if self.prefills:
            sums = {k: round(v, 4) for k, v in self.prefill_sums.items()}
            out["prefill"] = {"steps": self.prefills, "mixed_steps": self.mixed_steps, "tokens": self.prefill_tokens,
                              **sums,
                              "tokens_per_s": round(self.prefill_tokens / sums["wall_s"], 2) if sums["wall_s"] else None,
                              "r_append_s": [round(x, 4) for x in self.r_append_s]}
        if any(self.kv_saved_bytes_peak):
            out["kv_saved_bytes_peak"] = list(self.kv_saved_bytes_peak)
        if token_gaps.size:
            out["token_latency_p50_s"] = round(float(np.percentile(token_gaps, 50)), 6)
            out["token_latency_p99_s"] = round(float(np.percentile(token_gaps, 99)), 6)
        if self.r_time_n:
            mean = self.r_time_sum / self.r_time_n
            var = max(self.r_time_sq / self.r_time_n - mean * mean, 0.0)
            out["r_time_cv"] = round(float(np.sqrt(var) / mean), 4) if mean > 0 else None
        return out

    def document(self, summary: dict) -> dict:
        """The --stats-json file's content: the run's summary and its recorded steps."""
        return {"summary": summary, "steps_stride": self.stride, "steps": self.steps}


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
