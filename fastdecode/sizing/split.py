"""How a batch splits between the S-worker's own KV tier and the R-workers (docs/design.md, "The
S-worker's own tier in the sizing model").

The engine's placement (fastdecode/sched/placement.py) sends each new sequence where its step
would end earliest: on the tier the step's S side is the S-part's time plus the tier's attention
(`base_s` + load / speed), on an R-worker its own attention (load / speed), beside the S-part in
the pipeline. Greedily, the tier takes sequences until the two sides end together, or it is full,
or the R-workers have no room for the rest. Per step, with B_t sequences on the tier:

    S side     S_step + B_t·N·K_t·σ_t          S_step = N·d·T(B/d) + head(B)
    R side     (B - B_t)·N·K_R / ΣBW
    balance    B_t* = (B·K_R/ΣBW - S_step/N) / (K_t·σ_t + K_R/ΣBW)
    split      B_t = min(max(B_t*, B - fit_R, 0), fit_t, B),  B_R = B - B_t
               (in whole sequences: of the two around B_t*, the one whose step ends first)

K the KV bytes one sequence's attention reads per layer (its side's own: a shared prefix costs
the R-workers ρ per member-token, the tier a full read), σ_t the tier's seconds per KV byte, ΣBW
the R-workers' bytes per second together, fit_t and fit_R the sequences each side's memory holds.
Call overheads do not enter the split, as they do not enter placement's cost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# why the split is where it is (Split.why)
NO_TIER = "no tier"
BALANCED = "balanced"               # the two sides end together
TIER_FULL = "tier full"             # the balance point lies past what the tier holds
ALL_ON_TIER = "all on the tier"     # the tier holds the whole batch: one more R-worker sequence would end the step later
NONE_ON_TIER = "none on the tier"   # the S-part alone outlasts the R-workers' attention: the tier would slow the step
R_FULL = "R-workers full"           # the R-workers have no room for more: the tier holds the rest


@dataclass(slots=True)
class Split:
    tier: int           # sequences on the S-worker's tier
    rworkers: int       # sequences on the R-workers
    why: str            # one of the names above
    tier_fit: int       # sequences the tier holds at most
    rworker_fit: int    # sequences the R-workers hold at most


def split_batch(batch: int, s_step: float, layers: int, tier_bytes: float, tier_spb: float, r_bytes: float,
                r_bw: float, tier_fit: int, rworker_fit: int) -> Split:
    """The placement's split of `batch` sequences (the module docstring): s_step the S-part's
    seconds per decode step, tier_bytes and r_bytes the KV bytes one sequence's attention reads per
    layer on each side, tier_spb the tier's seconds per KV byte, r_bw the R-workers' bytes per
    second together (0: none). The batch must fit: batch <= tier_fit + rworker_fit."""
    if tier_fit <= 0:
        return Split(0, batch, NO_TIER, 0, rworker_fit)
    lo, hi = max(0, batch - rworker_fit), min(batch, tier_fit)
    if r_bw <= 0:
        return Split(hi, batch - hi, ALL_ON_TIER if hi == batch else TIER_FULL, tier_fit, rworker_fit)

    def step_end(tier: int) -> float:         # per layer: the later of the two sides
        return max(s_step / layers + tier * tier_bytes * tier_spb, (batch - tier) * r_bytes / r_bw)

    denom = tier_bytes * tier_spb + r_bytes / r_bw
    balance = (batch * r_bytes / r_bw - s_step / layers) / denom if denom > 0 else math.inf
    # whole sequences: of the two counts around the balance, the one whose step ends first (where
    # placement's greedy puts the last sequence), within what the two sides hold
    near = {min(max(x, lo), hi) for x in (math.floor(min(balance, hi)), math.ceil(max(balance, lo)))}
    tier = min(sorted(near), key=step_end)
    if tier == batch:
        why = ALL_ON_TIER
    elif tier == hi and balance >= hi:
        why = TIER_FULL
    elif tier == lo and balance <= lo:
        why = R_FULL if lo > 0 else NONE_ON_TIER
    else:
        why = BALANCED
    return Split(tier, batch - tier, why, tier_fit, rworker_fit)
