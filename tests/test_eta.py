"""The progress line's ETA on a shrinking batch: a synthetic job (sequences of spread lengths, a
step costing a + c * its tokens, a clock the test advances) through Progress as generate drives
it. Over the last half of the job the ETA stays within 25% of the time really left, where the
tokens left at the recent token rate run about 2x low (fewer tokens per step in the tail)."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest

from fastdecode.batch.progress import Progress, Snapshot, steps_to_finish, time_left

ETA = re.compile(r"eta=(\d+):(\d\d):(\d\d)")


def run_job(n: int, max_batch: int, admit_per_step: int, a: float, c: float, lo: int = 50, hi: int = 400,
            interval: float = 5.0) -> list[tuple[float, float, float]]:
    """(ETA shown, tokens left at the recent rate, time really left) at each progress line of a
    job's last half. Sequences run to their length; at most admit_per_step join a step (prefill
    limits admission), up to max_batch at once."""
    lengths = np.random.default_rng(1).integers(lo, hi + 1, n)
    queue, running = [int(x) for x in lengths], []
    clock = {"t": 0.0, "tokens": 0, "steps": 0}
    total = int(lengths.sum())

    def snapshot() -> Snapshot:
        at_once = len(running) if queue else max_batch
        work = steps_to_finish(np.array(running), np.array(queue), 0.0, at_once)
        return Snapshot(clock["tokens"], total, 0, n, len(running), len(queue), [], [], clock["steps"], work)

    out = io.StringIO()
    progress = Progress(snapshot, interval=interval, stream=out, clock=lambda: clock["t"])
    seen = []
    while queue or running:
        for _ in range(min(admit_per_step, max_batch - len(running), len(queue))):
            running.append(queue.pop(0))
        clock["t"] += a + c * len(running)
        clock["steps"] += 1
        clock["tokens"] += len(running)
        running = [r - 1 for r in running if r > 1]
        mark = out.tell()
        progress.update()
        shown = ETA.search(out.getvalue()[mark:])
        if shown:
            by_rate, _ = time_left(progress.samples, total - clock["tokens"], None)   # tokens at the recent rate
            eta = int(shown[1]) * 3600 + int(shown[2]) * 60 + int(shown[3])
            seen.append((clock["t"], eta, by_rate))
    end = clock["t"]
    return [(eta, by_rate, end - t) for t, eta, by_rate in seen if t >= end / 2 and end - t >= 2 * interval]


COSTS = {"mixed": (0.2, 0.004), "per-step": (0.5, 0.0), "per-token": (0.0, 0.004), "mostly-fixed": (1.0, 0.0005)}


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("job", ["one-batch", "queued"])
def test_eta_within_25_percent_over_the_last_half(cost, job):
    a, c = COSTS[cost]
    # one-batch: every request runs from the start (the tests' jobs); queued: the batch fills over
    # its first steps and is refilled from a queue until it drains, then shrinks
    shape = dict(n=300, max_batch=512, admit_per_step=512) if job == "one-batch" else \
        dict(n=600, max_batch=256, admit_per_step=8)
    rows = run_job(a=a, c=c, **shape)
    assert len(rows) >= 10
    errors = [(eta - left) / left for eta, _, left in rows]
    assert max(map(abs, errors)) <= 0.25, [round(e, 3) for e in errors]
    if a > 0:     # the tokens left at the recent rate run low in the tail (exact only where a step's cost is
        # all per token): the estimate this ETA replaced fails the same bound
        low = min((by_rate - left) / left for _, by_rate, left in rows)
        assert low < -0.25, low


def test_steps_to_finish_places_the_queue_in_the_slots_that_free_up():
    # two slots busy for 3 and 5 more tokens; the waiting 4 takes the first to free up (at 3)
    work = steps_to_finish(np.array([3, 5]), np.array([4]), 0.0, 2)
    assert (work.steps, work.full_steps, work.tail_tokens) == (7, 5, 2)
    # lines not read yet pour evenly over the slots
    assert steps_to_finish(np.array([2, 6]), np.array([]), 8.0, 2).steps == 8
    # no queue: free slots end at once, the whole of it is a tail
    work = steps_to_finish(np.array([4, 1]), np.array([]), 0.0, 8)
    assert (work.steps, work.full_steps, work.tail_tokens) == (4, 0, 5)
