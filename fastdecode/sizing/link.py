"""The S<->R link in the sizing model: fitting measured message times, pricing one mini-batch's
messages over P R-workers, and what plan says where the link bounds.

A step sends each R-worker its rows' Q, K, V per layer and mini-batch and gets their O back
(rpart/mpi.py: one message each way per worker, all workers' in flight together). Each R-worker
holds a share of the rows proportional to its attention bandwidth (placement), so its messages
carry that share of the bytes. Two things can bound:
- an R-worker's own link: its share of the bytes over its table (the slowest of them bounds);
- the S-worker's path, which carries every R-worker's messages: the mini-batch's bytes at the
  bandwidth measured to all R-workers at once (`concurrent_Bps`).
Links are full duplex: a mini-batch's chain waits for its Q, K, V out and then its O back, but
the link's load per layer is the busier direction's (out and back of different mini-batches pass
at once), at the rate a busy link sustains (`sustained`). Where that was not measured
  (stated hardware, an older profile) the R-workers' messages share one path: the whole
  mini-batch's bytes over the slowest worker's table.
"""
from __future__ import annotations

import numpy as np

from fastdecode.sizing.schema import LinkProfile, RWorkerProfile

FIT_FROM_BYTES = 256 << 10     # the bandwidth is fitted over messages this big or bigger (past MPI's eager sizes)
S_PATH = "the S-worker's path (all R-workers at once)"


def fit_link(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of a one-way time table: the latency is the smallest message's
    time, the bandwidth the least-squares slope over messages of FIT_FROM_BYTES and more (the
    two largest if fewer are that big): small messages go eagerly and say little about a big
    one's rate over TCP. Bandwidth 1e15 where the times do not grow (no link to speak of)."""
    x, t = np.asarray(sizes, np.float64), np.asarray(times, np.float64)      # [sizes]
    big = x >= FIT_FROM_BYTES
    if big.sum() < 2:
        big = np.arange(len(x)) >= len(x) - 2
    slope = np.polyfit(x[big], t[big], 1)[0] if big.sum() >= 2 else 0.0
    return float(t[0]), float(1.0 / slope) if slope > 0 else 1e15


def shares(workers: list[RWorkerProfile]) -> np.ndarray:
    """[P] the share of a mini-batch's rows each R-worker holds: proportional to its bandwidth."""
    bw = np.array([w.bandwidth() for w in workers])
    return bw / bw.sum()


def sustained(table_s: float, latency_s: float, bandwidth_Bps: float, nbytes: float) -> float:
    """A message's share of a direction kept busy: its table time (an isolated message, which a
    shaper's token bucket or a switch's buffer may pass faster than the rate), never less than
    latency + bytes at the bandwidth fitted over big messages (the rate a busy link sustains)."""
    return max(table_s, latency_s + nbytes / bandwidth_Bps) if nbytes > 0 else 0.0


def mini_batch_link(link: LinkProfile, workers: list[RWorkerProfile], out_bytes: float,
                    back_bytes: float) -> dict:
    """One mini-batch's messages in one layer, Q, K, V out and O back, over P = len(workers)
    R-workers (module docstring): {"s": the chain's link time (out, then back), "load": what the
    mini-batch takes of the busier direction (the link is full duplex: out and back of different
    mini-batches pass at once), "by": what bounds (a worker's name or S_PATH), "bytes": the
    bytes on that path's busier direction, "latency_s": the latency in "load"}. A GPU S-worker's
    device<->host copies are not included (LinkProfile.device_time)."""
    if not link.per_worker() or link.concurrent_Bps <= 0:       # one path for every worker's messages
        distinct = range(min(len(workers), max(len(link.worker_message_time_s), 1)))
        paths = [_worker_path(link, w, out_bytes, back_bytes) for w in distinct]
        worst = max(range(len(paths)), key=lambda w: (paths[w]["load"], paths[w]["s"]))
        return {**paths[worst], "by": link.worker_name(worst)}
    share = shares(workers)
    paths = [_worker_path(link, w, out_bytes * f, back_bytes * f) for w, f in enumerate(share)]
    worst = max(range(len(paths)), key=lambda w: (paths[w]["load"], paths[w]["s"]))
    best = {**paths[worst], "by": link.worker_name(worst)}
    latency = min(link.worker_latency_s)
    s_path = dict(s=2 * latency + (out_bytes + back_bytes) / link.concurrent_Bps,
                  load=latency + max(out_bytes, back_bytes) / link.concurrent_Bps, by=S_PATH,
                  bytes=max(out_bytes, back_bytes), latency_s=latency)
    return s_path if len(workers) > 1 and s_path["load"] > best["load"] else best


def _worker_path(link: LinkProfile, w: int, out_bytes: float, back_bytes: float) -> dict:
    """R-worker w's own link for `out_bytes` out and `back_bytes` back."""
    table = [link.worker_time(w, out_bytes), link.worker_time(w, back_bytes)]
    latency, bandwidth = ((link.worker_latency_s[w % len(link.worker_latency_s)],
                           link.worker_bandwidth_Bps[w % len(link.worker_bandwidth_Bps)])
                          if link.per_worker() else (link.latency_s, link.bandwidth_Bps))
    each = [sustained(t, latency, bandwidth, n) for t, n in zip(table, (out_bytes, back_bytes))]
    busier = int(each[1] > each[0])
    return dict(s=sum(table), load=each[busier], bytes=(out_bytes, back_bytes)[busier], latency_s=latency)
