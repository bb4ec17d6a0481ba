"""The runner's host-side bookkeeping: mini-batches of equal R-load and per-row sampling
parameters built from arrays, against direct per-row computations."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.engine.runner import split_by_r_load
from fastdecode.engine.sampler import SamplingBatch
from fastdecode.engine.sampling_params import SamplingParams


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(1, 6), st.randoms())
def test_split_by_r_load_partitions_and_balances(lengths, depth, rnd):
    kv = np.array(lengths, dtype=np.int64)
    ids = np.array(rnd.sample(range(10 ** 6), len(lengths)), dtype=np.int64)
    parts = split_by_r_load(kv, ids, depth)
    assert len(parts) == min(depth, len(lengths))
    rows = np.concatenate(parts)
    assert sorted(rows.tolist()) == list(range(len(lengths)))          # every row exactly once
    assert all(len(p) and (np.diff(p) > 0).all() for p in parts)       # non-empty, in row order
    loads = [int(kv[p].sum()) for p in parts]
    assert max(loads) - min(loads) <= kv.max()                          # within the longest sequence
    # depends only on (length, id) pairs, not on the order the rows came in
    perm = np.array(rnd.sample(range(len(lengths)), len(lengths)))
    again = split_by_r_load(kv[perm], ids[perm], depth)
    assert sorted(sorted(ids[perm][p].tolist()) for p in again) == sorted(sorted(ids[p].tolist()) for p in parts)


def test_sampling_batch_from_arrays_matches_per_row_construction():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05), SamplingParams(temperature=0)]
    rows = [(p, 11 + i, i, 3 * i, [7] if i == 1 else None) for i, p in enumerate(params)]
    a = SamplingBatch(rows, "cpu")
    cols = np.array([(p.temperature, p.top_k, p.top_p, p.min_p) for p in params], dtype=np.float64)
    b = SamplingBatch.from_arrays(cols, np.arange(11, 15), np.arange(4), 3 * np.arange(4), {1: [7]}, "cpu")
    for batch in (a, b):
        assert batch.sample_rows.tolist() == [1, 2]                    # temperature 0 rows never sample
        assert batch.needs_filter
        assert batch.suppress == {1: [7]}
    for name in ("top_k", "top_p", "min_p", "seeds", "streams", "positions", "sample_rows"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.temperature.flatten().tolist() == b.temperature.flatten().tolist()
    greedy = SamplingBatch([(SamplingParams(temperature=0), 0, 0, 0, None)] * 3, "cpu")
    assert greedy.sample_rows.size == 0 and greedy.temperature is None and not greedy.needs_filter
