"""Generation lengths learnt from finished sequences, for the admission projection.

A sequence that stops at EOS after L tokens tells us its natural length; one that reaches
max_tokens m only tells us L > m (right-censored). The Kaplan-Meier estimator turns both into a
survival curve Sv(x) = P(L > x) over the last `window` finished sequences and the running ones
(censored at their age), from which the
admission controller projects a running sequence (g tokens generated, bound m) to be alive at
step now+t with probability Sv(g+t)/Sv(g) up to its bound, instead of surely until m.
"""
from __future__ import annotations

import numpy as np


class LengthModel:
    def __init__(self, window: int = 4096, min_events: int = 16):
        self.window = window
        self.min_events = min_events          # EOS stops needed before the curve is trusted
        self._length = np.zeros(window, np.int64)   # [window] ring of tokens generated
        self._stopped = np.zeros(window, bool)      # [window] ... and whether it was an EOS stop
        self._seen = 0                        # sequences observed (the ring holds the last `window`)
        self._events = 0                      # EOS stops in the window
        self._running = np.zeros(0, np.int64)  # [n] ages of the running sequences (censored)
        self._sv: np.ndarray | None = None    # [X+1] Sv(0..X), X = longest observation
        self._cum: np.ndarray | None = None   # [X+2] C(x) = sum_{y<x} Sv(y)
        self._cum2: np.ndarray | None = None  # [X+2] sum_{y<x} (2y+1) Sv(y)

    def observe(self, generated: int, stopped: bool) -> None:
        """A sequence finished after `generated` tokens; stopped = at EOS/stop (not max_tokens)."""
        if generated < 1:
            return
        slot = self._seen % self.window
        if self._seen >= self.window:
            self._events -= bool(self._stopped[slot])
        self._length[slot], self._stopped[slot] = generated, stopped
        self._seen += 1
        self._events += bool(stopped)
        self._sv = None

    def set_running(self, generated: np.ndarray) -> None:
        """Ages of the sequences running now. Each is a censored observation (L > g): without
        them the curve learns only from sequences that already stopped, which early in a run
        are the short ones, and underestimates lengths."""
        generated = np.asarray(generated, dtype=np.int64)
        if not np.array_equal(generated, self._running):
            self._running = generated.copy()
            self._sv = None

    @property
    def ready(self) -> bool:
        """Enough EOS stops to learn from. With none (every sequence ran to max_tokens) the
        bound is the best projection and the controller keeps using it."""
        return self._events >= self.min_events

    def describe(self) -> dict:
        out = {"finished_seen": self._seen, "eos_stops": self._events, "ready": self.ready}
        if self.ready:
            self._fit()
            out["mean_len_unbounded"] = round(float(self._cum[-1]), 1)   # E[min(L, longest seen)]
        return out

    # ---------------------------------------------------------------- fit

    def _fit(self) -> None:
        if self._sv is not None:
            return
        n = min(self._seen, self.window)
        running = self._running[self._running > 0]
        length = np.concatenate([self._length[:n], running])
        stopped = np.concatenate([self._stopped[:n], np.zeros(running.size, bool)])
        X = int(length.max())
        # at risk at x (x >= 1): observed length >= x; events at x: EOS stops after x tokens
        at_risk = length.size - np.concatenate([[0], np.cumsum(np.bincount(length, minlength=X + 1))[:-1]])
        events = np.bincount(length[stopped], minlength=X + 1)
        hazard = np.divide(events, at_risk, out=np.zeros(X + 1), where=at_risk > 0)
        hazard[0] = 0.0                       # every sequence generates at least one token
        sv = np.cumprod(1.0 - hazard)         # Sv(x) = P(L > x) = prod_{y<=x} (1 - h(y))
        self._sv = sv
        self._cum = np.concatenate([[0.0], np.cumsum(sv)])
        self._cum2 = np.concatenate([[0.0], np.cumsum((2 * np.arange(X + 1) + 1) * sv)])

    def _sv_at(self, x: np.ndarray) -> np.ndarray:
        """Sv beyond the longest observation stays at its last value (no evidence of stopping)."""
        return self._sv.take(x, mode="clip")

    def survival(self, x: np.ndarray) -> np.ndarray:
        """Sv(x) = P(L > x): the chance a new sequence is still running in its x-th step."""
        self._fit()
        return self._sv_at(np.asarray(x, dtype=np.int64))

    def _sum_sv(self, x: np.ndarray) -> np.ndarray:
        """C(x) = sum_{y<x} Sv(y), extended past the data with Sv's last value."""
        last = self._cum.size - 1
        return self._cum[np.minimum(x, last)] + np.maximum(x - last, 0) * self._sv[-1]

    def _sum_sv2(self, x: np.ndarray) -> np.ndarray:
        """sum_{y<x} (2y+1) Sv(y), extended likewise (sum of 2y+1 over [a, b) is b^2 - a^2)."""
        last = self._cum2.size - 1
        lo = np.minimum(x, last)
        return self._cum2[lo] + (x.astype(np.float64) ** 2 - lo.astype(np.float64) ** 2) * self._sv[-1]

    # ---------------------------------------------------------------- queries

    def expected_curve(self, kv: np.ndarray, generated: np.ndarray, left: np.ndarray,
                       t: np.ndarray) -> np.ndarray:
        """E[W(t)] = sum_i (kv_i + t + 1) * P(L_i > g_i + t | L_i > g_i) * [t < left_i]: the
        expected KV tokens these sequences hold during step now+t (the expectation of
        admission.projected_workload, whose terms are all 0/1). Sequences are grouped by
        (age, bound), which a micro-batched schedule keeps few. Returns [len(t)] float64."""
        t = np.asarray(t, dtype=np.int64)
        if not self.ready:
            raise RuntimeError("expected_curve needs a ready model")
        self._fit()
        generated, left = np.asarray(generated, np.int64), np.asarray(left, np.int64)
        if generated.size == 0:
            return np.zeros(t.size)
        span = int(left.max()) + 1
        keys, inv = np.unique(generated * span + left, return_inverse=True)   # [U] (age, bound) groups
        n = np.bincount(inv, minlength=keys.size).astype(np.float64)           # [U] sequences
        k1 = np.bincount(inv, weights=np.asarray(kv, np.float64) + 1.0, minlength=keys.size)  # [U] sum (kv + 1)
        g, lft = keys // span, keys % span
        sv_g = self._sv_at(g)                                                   # [U]
        alive = self._sv_at(g[:, None] + t[None, :])                            # [U, J] Sv(g + t)
        alive *= (1.0 / np.where(sv_g > 0, sv_g, 1.0))[:, None]
        alive[sv_g <= 0] = 1.0                  # older than any seen: keep the bound
        alive[t[None, :] >= lft[:, None]] = 0.0
        return k1 @ alive + (n @ alive) * t

    def mean_len(self, max_tokens: np.ndarray) -> float | None:
        """Mean over requests with bounds m_i of E[min(L, m_i)]: a sequence's mean lifetime."""
        m = np.asarray(max_tokens, dtype=np.int64)
        if not self.ready or m.size == 0:
            return None
        self._fit()
        return float(self._sum_sv(m).mean())

    def expected_length(self, generated: np.ndarray, max_tokens: np.ndarray) -> np.ndarray:
        """E[min(L, m_i) | L > g_i] per sequence: the tokens a sequence that has generated g_i of at
        most m_i will have when it ends (progress's expected total). min(L, m) = sum_{y<m} [L > y],
        and given L > g the terms y <= g are 1, so E = g + 1 + sum_{g<y<m} Sv(y) / Sv(g); a
        sequence older than any seen (Sv(g) = 0) keeps its bound. Returns [n] float64."""
        g = np.asarray(generated, dtype=np.int64)
        m = np.asarray(max_tokens, dtype=np.int64)
        if not self.ready:
            raise RuntimeError("expected_length needs a ready model")
        self._fit()
        sv_g = self._sv_at(g)                                            # [n]
        start = np.minimum(g + 1, m)
        tail = self._sum_sv(m) - self._sum_sv(start)                     # [n] sum_{g<y<m} Sv(y)
        out = start + tail / np.where(sv_g > 0, sv_g, 1.0)
        out = np.where(sv_g > 0, out, m)
        return np.maximum(out, np.minimum(g, m)).astype(np.float64)

    def length_biased_mean(self, max_tokens: np.ndarray) -> float | None:
        """sum_i E[min(L, m_i)^2] / sum_i E[min(L, m_i)] over requests with bounds m_i: the
        S that makes B*S/2 the mean growth term of B running sequences (renewal theory)."""
        m = np.asarray(max_tokens, dtype=np.int64)
        if not self.ready or m.size == 0:
            return None
        self._fit()
        return float(self._sum_sv2(m).sum() / max(self._sum_sv(m).sum(), 1e-12))
