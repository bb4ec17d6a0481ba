"""The balance rule: what of a batch the engine runs, and the most tokens/s each socket count gives.

The engine admits a sequence to an R-worker only while that raises tokens/s: the S-worker's own
tier takes sequences wherever it is the faster place, and the R-workers fill only to their balance
point (their attention per step within the S side's, the S-part plus the tier's attention), past it
only while one more still raises tokens/s, (B+1)/T(B+1) > B/T(B). Memory is a cap, not the target.
Of a batch offered, plan runs the better (in tokens/s) of two fillings, each with the R-workers'
share cut to the count b that gives the most tokens/s:

    placement    the tier's share as placement gives it (a sequence where its step ends earliest,
                 sizing/split.py), the rest to the R-workers
    tier first   the tier full (or the whole batch on it), the rest to the R-workers

Tier first with b = 0 is the card alone on that batch, so at every batch and pipeline depth P
R-workers do at least as well as the card alone, and better wherever one more sequence on them
raises tokens/s. Sequences of the batch that memory holds but the cut leaves out wait
(Prediction.balance_waiting); offered more, the run stays at the balance point.

With B_t sequences on the tier, tokens/s over b is (B_t + b) / step(b), and once a side bounds the
step every part of it (S-part, R-part, link, prefill) grows about linearly in b: tokens/s rises,
then falls at most once. So the best b is where one more stops raising it, found by bisection (the
ends of the range weighed too, should a profile's measured curve bend otherwise).

best_per_sockets gives the best over a sweep of batches per socket count: powers of 2 from 1 to
what memory holds, with the points where the tier fills and where the R-workers reach their
balance, at pipeline depth 1 and 2 (or a stated one).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastdecode.sizing.model import Prediction, predict, predict_run
from fastdecode.sizing.schema import Profile
from fastdecode.sizing.split import ALL_ON_TIER, TIER_FULL, Split

DEPTHS = (1, 2)             # pipeline depths weighed where none is stated
MAX_SWEEP_BATCH = 1 << 16   # the sweep's largest power of 2 (what memory holds caps it before, mostly)
NEEDED_SWEEP_BATCH = 1 << 14    # its largest where the R-workers are the number needed (no memory caps it)
PLACEMENT_ROUNDS = 4        # placement's filling: cut, then the waiting to the tier, at most this often


@dataclass(frozen=True, slots=True)
class Workload:
    """What the batch runs: generation length S, prompt, and how KV is reserved and shared
    (predict's arguments of the same names)."""
    gen_len: int
    prompt_len: int = 0
    prefill_chunk: int | None = None
    kv_reserve: str = "full"
    shared_prefix: int = 0
    prefix_group: int | None = None

    def options(self) -> dict:
        return dict(prefill_chunk=self.prefill_chunk, kv_reserve=self.kv_reserve, shared_prefix=self.shared_prefix,
                    prefix_group=self.prefix_group)


def balanced_predict(profile: Profile, batch: int, work: Workload, rworkers: int | None, depth: int) -> Prediction:
    """What runs of `batch` sequences offered under the balance rule (the module docstring), at
    `depth` mini-batches; `rworkers` None: the number needed at this batch. Without a tier or
    without R-workers there is nothing to weigh: every sequence memory holds runs (with nothing
    else in the step, each one on an R-worker raises tokens/s)."""
    placed = predict(profile, batch, work.gen_len, work.prompt_len, rworkers, depth, **work.options())
    if not placed.tier_capacity_sequences or not placed.rworkers or not placed.rworker_sequences:
        return placed
    held, fit = placed.batch_run, placed.tier_capacity_sequences     # what memory holds of the batch; the tier
    runs = [_placement_filling(profile, batch, work, placed)]
    if min(held, fit) != placed.tier_sequences:
        on_tier = min(held, fit)
        runs.append(_cut_rworkers(profile, batch, work, placed, on_tier, held - on_tier,
                                  ALL_ON_TIER if on_tier == held else TIER_FULL))
    return max(runs, key=lambda p: p.tokens_per_s)           # ties: placement's filling, the first


def _placement_filling(profile: Profile, batch: int, work: Workload, placed: Prediction) -> Prediction:
    """Placement's filling: its tier share, the R-workers' cut at their balance; what the cut
    leaves waiting then goes to the tier while it has room (with the R-workers at their balance
    the tier is the faster place), which lengthens the S side and so may move their balance: a
    few rounds, until nothing moves."""
    held, fit = placed.batch_run, placed.tier_capacity_sequences
    tier, best = placed.tier_sequences, None
    for _ in range(PLACEMENT_ROUNDS):
        run = _cut_rworkers(profile, batch, work, placed, tier, held - tier, placed.tier_split)
        if best is None or run.tokens_per_s > best.tokens_per_s:
            best = run
        more = min(fit, tier + run.balance_waiting)
        if more == tier:
            break
        tier = more
    return best


def _cut_rworkers(profile: Profile, batch: int, work: Workload, placed: Prediction, tier: int, share: int,
                  why: str) -> Prediction:
    """`tier` sequences on the tier and, of the `share` left for the R-workers, the count giving
    the most tokens/s."""
    runs: dict[int, Prediction] = {}

    def run(on_r: int) -> Prediction:
        if on_r not in runs:
            split = Split(tier, on_r, why, placed.tier_capacity_sequences, placed.rworker_capacity_sequences)
            runs[on_r] = predict_run(profile, batch, work.gen_len, work.prompt_len, placed.rworkers,
                                     placed.pipeline_depth, placed.rworkers_needed, split, **work.options())
        return runs[on_r]

    least = 0 if tier else 1                                  # something must run
    return run(best_count(lambda b: run(b).tokens_per_s, least, share))


def best_count(tokens_per_s: Callable[[int], float], lo: int, hi: int) -> int:
    """The count in [lo, hi] past which one more no longer raises `tokens_per_s`: bisection for
    the first fall (tokens/s rises then falls at most once: the module docstring), with both ends
    weighed too; ties go to the fewer."""
    a, b = lo, hi
    while a < b:
        mid = (a + b) // 2
        if tokens_per_s(mid + 1) > tokens_per_s(mid):
            a = mid + 1
        else:
            b = mid
    return max(sorted({lo, a, hi}), key=tokens_per_s)


def depths_for(batch: int, depth: int | None) -> list[int]:
    """The pipeline depths to weigh at `batch`: the stated one, or DEPTHS; never more
    mini-batches than sequences."""
    return sorted({min(d, batch) for d in ((depth,) if depth else DEPTHS)})


def best_depth(profile: Profile, batch: int, work: Workload, rworkers: int | None, depth: int | None) -> Prediction:
    """balanced_predict at the stated depth, or the better of DEPTHS (ties: the shallower)."""
    runs = [balanced_predict(profile, batch, work, rworkers, d) for d in depths_for(batch, depth)]
    return max(runs, key=lambda p: p.tokens_per_s)


def sweep_batches(profile: Profile, work: Workload, rworkers: int | None, depth: int | None,
                  also: tuple[int, ...] = ()) -> list[int]:
    """The batches to weigh: powers of 2 from 1 up to what memory holds (at most MAX_SWEEP_BATCH),
    that count itself, where the tier fills, where the R-workers reach their balance (what runs of
    all memory holds), and `also` (e.g. the knee). Where `rworkers` is None (the count needed at
    each batch, which holds it) no memory caps the sweep: powers of 2 up to NEEDED_SWEEP_BATCH."""
    if rworkers is None:
        return sorted({*(2 ** i for i in range(NEEDED_SWEEP_BATCH.bit_length())), *also})
    full = predict(profile, MAX_SWEEP_BATCH, work.gen_len, work.prompt_len, rworkers, 1,      # memory: any depth
                   **work.options())
    memory = max(full.batch_run, 1)
    points = {2 ** i for i in range(memory.bit_length()) if 2 ** i <= memory} | {memory, *also}
    if 0 < full.tier_capacity_sequences < memory:
        points.add(full.tier_capacity_sequences)
    for d in depths_for(memory, depth):
        points.add(max(balanced_predict(profile, memory, work, rworkers, d).batch_run, 1))
    return sorted(points)


def sweep(profile: Profile, work: Workload, rworkers: int | None, depth: int | None = None,
          batches: list[int] | None = None) -> list[Prediction]:
    """One prediction per batch of `batches` (default: sweep_batches), each at its better depth."""
    batches = batches or sweep_batches(profile, work, rworkers, depth)
    return [best_depth(profile, b, work, rworkers, depth) for b in batches]


def best_of(preds: list[Prediction]) -> Prediction:
    """The most tokens/s (ties: the smaller batch, the first)."""
    return max(preds, key=lambda p: p.tokens_per_s)


def best_per_sockets(profile: Profile, sockets: list[int], gen_len: int, prompt_len: int = 0,
                     depth: int | None = None, batches: list[int] | None = None, prefill_chunk: int | None = None,
                     kv_reserve: str = "full", shared_prefix: int = 0, prefix_group: int | None = None) -> list[dict]:
    """Per socket count (R-workers; the card alone, 0, first wherever the profile has a tier),
    the best prediction over `batches` (default: sweep_batches) at `depth` (default: the better
    of 1 and 2), as predict's dict with:
        adds_tokens_per_s            over the previous row (None on the first)
        over_card_alone_tokens_per_s over the card alone's row (None without a tier)
        card_alone_best              R-workers given, and the best puts nothing on them
        batches_weighed              how many batches the sweep weighed"""
    work = Workload(gen_len, prompt_len, prefill_chunk, kv_reserve, shared_prefix, prefix_group)
    counts = sorted(set(sockets) | ({0} if profile.device_tier is not None else set()))
    rows: list[dict] = []
    for count in counts:
        preds = sweep(profile, work, count, depth, batches)
        rows.append({**best_of(preds).to_dict(), "batches_weighed": len(preds)})
    card = rows[0]["tokens_per_s"] if counts[0] == 0 else None
    for i, row in enumerate(rows):
        row["adds_tokens_per_s"] = row["tokens_per_s"] - rows[i - 1]["tokens_per_s"] if i else None
        row["over_card_alone_tokens_per_s"] = None if card is None else row["tokens_per_s"] - card
        row["card_alone_best"] = bool(row["rworkers"] and card is not None and not row["rworker_sequences"])
    return rows
