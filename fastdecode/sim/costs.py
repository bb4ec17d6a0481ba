"""What each piece of work costs, from a Profile: the tables and constants the event loop reads.

The same readings `fastdecode plan` makes (fastdecode/sizing/model.py): the S-part of one layer
at a batch (SWorkerProfile.layer_time), the LM head, an R-worker's seconds per KV byte read and
per call, the link's time by message size (plus a GPU's device<->host copies), the hand-off per
layer, and prefill per prompt token by prompt length and chunk. The S-worker's own KV tier, where
the profile has one, is one more worker after the R-workers (`tier`), as in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from fastdecode.sizing.schema import Profile


@dataclass(slots=True)
class Costs:
    layers: int
    s_table: np.ndarray         # [max_batch + 1] seconds of one layer's S-part at each mini-batch size
    head_table: np.ndarray      # [max_batch + 1] LM head + sampling of a step at each batch
    r_token_s: np.ndarray       # [W] seconds per KV token read, one layer (W = P R-workers, then the tier)
    r_call_s: np.ndarray        # [W] seconds per attention call
    out_bytes_row: float        # Q, K, V of one row, one layer, S -> R
    back_bytes_row: float       # attention output of one row, one layer, R -> S
    link: np.ndarray            # [6] latency s, bandwidth B/s, device d2h B/s, h2d B/s, hop s, 0
    msg_bytes: np.ndarray       # [k] the link's measured message sizes (may be empty)
    msg_time: np.ndarray        # [k] one-way seconds for each
    windows: np.ndarray         # [layers] sliding window per layer (0: full); empty: all full
    kv_bytes_token: float       # K and V of one token over every layer (what placement reserves)
    profile: Profile
    rworkers: int = 0           # P
    tier: int = -1              # the S-worker's own tier's worker index (P), -1: none

    @property
    def num_workers(self) -> int:
        return self.rworkers + (self.tier >= 0)

    def read_tokens(self, kv_len: np.ndarray) -> np.ndarray:
        """[n] tokens read per layer, averaged over the layers: a windowed layer reads its window."""
        kv = kv_len.astype(np.float64)
        if not self.windows.size:
            return kv
        w = np.where(self.windows > 0, self.windows, np.inf)[None, :]          # [1, L]
        return np.minimum(kv[:, None], w).mean(axis=1)

    def prefill_s(self, prompt_lens: np.ndarray, sent: np.ndarray | None = None) -> float:
        """Seconds to prefill these prompts as one chunk (one step's admissions); `sent` [n] marks
        those whose K, V leave for an R-worker (default all; the tier's are written in place)."""
        sw, m = self.profile.s_worker, self.profile.model
        chunk = float(prompt_lens.sum())
        if sw.prefill_prompt_len:
            lens, count = np.unique(prompt_lens, return_counts=True)
            return float(sum(c * p * sw.prefill_time_per_token(p, chunk) for p, c in zip(lens.tolist(), count.tolist())))
        # stated hardware: the dense layers at the best efficiency measured (as `plan`), and the
        # prompts' K, V over the link, each layer's sent as it is computed (the engine's prefill
        # streams them, rpart/mpi.py): the longer of the two, and one layer of the shorter to fill
        best = max(b / t for b, t in zip(sw.batch_grid, sw.layer_time_s))
        kv = float(prompt_lens[sent].sum() if sent is not None else chunk) * self.kv_bytes_token
        compute, link = chunk * m.num_layers / best, kv / self.link[1]
        return max(compute, link) + min(compute, link) / m.num_layers

    def trip(self) -> tuple[float, float]:
        """(seconds fixed, seconds per row) of a mini-batch's R-rows there and back over every layer,
        from the stated link (what the engine's start-up echo measures: engine/rpart_setup.py
        trip_prior), the device copies included."""
        lat, bw, d2h, h2d, hop = (float(x) for x in self.link[:5])
        per_row = (self.out_bytes_row + self.back_bytes_row) / bw + (self.out_bytes_row / d2h if d2h > 0 else 0.0) \
            + (self.back_bytes_row / h2d if h2d > 0 else 0.0)
        return self.layers * (2 * lat + hop), self.layers * per_row

    def workers(self) -> list:
        """What placement reads of each worker (fastdecode/sched/placement.py): the R-workers, then
        the S-worker's own tier."""
        tier = [self.profile.device_tier] if self.tier >= 0 else []
        return [SimpleNamespace(capacity_bytes=int(w.capacity_bytes), page_tokens=max(int(w.page_tokens), 1),
                                frees_windows=getattr(w, "frees_windows", True))
                for w in self.profile.workers(self.rworkers) + tier]

    def speeds(self) -> list[float]:
        """Each worker's speed as the engine's placement measures it at start-up: KV tokens (all
        layers) per second of its kernel alone (engine/kv_tiers.py measured_speeds)."""
        tier = [self.profile.device_tier] if self.tier >= 0 else []
        return [1.0 / (self.kv_bytes_token * (w.kernel_seconds_per_kv_byte or w.seconds_per_kv_byte))
                for w in self.profile.workers(self.rworkers) + tier]


def costs_of(profile: Profile, rworkers: int, max_batch: int) -> Costs:
    """The costs of a job on `rworkers` R-workers (the profile's, repeated) and the profile's own
    S-worker tier, if it has one."""
    m, sw = profile.model, profile.s_worker
    workers = profile.workers(rworkers) + ([profile.device_tier] if profile.device_tier is not None else [])
    kv_tok = m.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    grid = np.arange(max_batch + 1)
    s_table = np.array([0.0] + [sw.layer_time(b) for b in grid[1:]])
    head = np.array([0.0] + [sw.head_time(b) for b in grid[1:]])
    link = profile.link
    return Costs(layers=m.num_layers, s_table=s_table, head_table=head,
                 r_token_s=np.array([kv_tok * w.seconds_per_kv_byte for w in workers]),
                 r_call_s=np.array([w.call_overhead_s for w in workers], np.float64),
                 out_bytes_row=float(m.to_rworker_bytes_per_token()),
                 back_bytes_row=float(m.from_rworker_bytes_per_token()),
                 link=np.array([link.latency_s, link.bandwidth_Bps, link.device_d2h_Bps, link.device_h2d_Bps,
                                link.hop_s, 0.0]),
                 msg_bytes=np.asarray(link.message_bytes, np.float64), msg_time=np.asarray(link.message_time_s,
                                                                                            np.float64),
                 windows=np.asarray(m.windows, np.float64), kv_bytes_token=float(kv_tok * m.num_layers),
                 profile=profile, rworkers=rworkers, tier=rworkers if profile.device_tier is not None else -1)
