"""Memory the limits count: the input's line counter streams (a line of any length costs one
chunk), allowed_token_ids is bounded by --max-list-items and counted in the memory a request
pins, and its mask is built from an array made once per request, not from the list every step."""
from __future__ import annotations

import gc
import json
import tracemalloc
import types

import numpy as np
import pytest
import torch

from fastdecode.batch.jsonl import count_lines, parse_line, read_lines
from fastdecode.batch.schema import Limits
from fastdecode.engine.request_checks import RequestChecks, RequestError, list_bytes
from fastdecode.engine.sampler import sample
from fastdecode.engine.sampling_params import SamplingParams
from fastdecode.engine.sequence import Request, Sequence

VOCAB = 49152


def peak_of(fn):
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_line_counter_streams_a_line_without_a_newline(tmp_path):
    """64 MB of one line and no newline: the old counter held it whole (and more: 2x for a 2 GB line)."""
    path = tmp_path / "in.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"a": 1}\n   \n')
        f.writelines(b"x" * (1 << 20) for _ in range(64))
    count, peak = peak_of(lambda: count_lines(str(path)))
    assert count == 2
    assert peak < 4 << 20, f"counting held {peak / 2**20:.0f} MiB"
    rows, peak = peak_of(lambda: [(r.line_no, r.error.code if r.error else None)
                                  for r in read_lines(str(path), Limits(max_line_bytes=1 << 20))])
    assert rows == [(1, "invalid_request"), (3, "request_too_large")] and peak < 8 << 20


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_the_line_counter_counts_as_lines_are_read(tmp_path, chunk):
    rng = np.random.default_rng(chunk)
    for _ in range(30):
        data = bytes(rng.choice(list(b"ab \n\r\t"), size=int(rng.integers(0, 60))).tolist())
        path = tmp_path / "f"
        path.write_bytes(data)
        assert count_lines(str(path), chunk) == sum(1 for piece in data.split(b"\n") if piece.strip())


def line_with(field: str, value) -> bytes:
    return json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "Hi", field: value}}).encode()


def test_allowed_token_ids_is_bounded_by_max_list_items():
    row = parse_line(1, line_with("allowed_token_ids", list(range(1025))))
    assert row.error is not None and row.error.code == "request_too_large"
    assert "body.allowed_token_ids must have at most 1024 entries (--max-list-items), got 1025" in str(row.error)
    assert parse_line(1, line_with("allowed_token_ids", list(range(1024)))).error is None


def checks(max_request_mem: int = 1 << 30) -> RequestChecks:
    return RequestChecks(VOCAB, 4096, frozenset({2}), lambda text: [5], 20, max_request_mem)


def test_a_requests_lists_count_in_the_memory_it_pins():
    """What a parsed line's lists hold (measured) is at most what the request is charged for them."""
    ids = np.random.default_rng(0).integers(0, VOCAB, 200_000).tolist()
    raw = line_with("allowed_token_ids", ids)
    lines = Limits(max_list_items=1 << 20)

    def parse_and_check():
        row = parse_line(1, raw, lines)
        return row, checks().check([1, 2, 3], row.params)

    gc.collect()
    tracemalloc.start()
    (row, checked) = parse_and_check()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert row.error is None
    assert list_bytes(row.params) >= held, (list_bytes(row.params), held)
    assert checked.pinned_bytes >= list_bytes(row.params)
    with pytest.raises(RequestError, match="more than --max-request-mem") as err:
        checks(max_request_mem=8 << 20).check([1, 2, 3], row.params)
    assert err.value.code == "request_too_large"
    for field, value in (("logit_bias", {str(i): 1.0 for i in range(50_000)}), ("stop", [f"w{i}" for i in range(50_000)]),
                         ("stop_token_ids", list(range(50_000)))):
        gc.collect()
        tracemalloc.start()
        row = parse_line(1, line_with(field, value), lines)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert list_bytes(row.params) >= held * 0.9, (field, list_bytes(row.params), held)


class CountedList(list):
    """A list that counts the times it is walked."""
    walks = 0

    def __iter__(self):
        CountedList.walks += 1
        return super().__iter__()


def test_the_allowed_mask_is_built_from_an_array_made_once():
    from fastdecode.engine.runner import ModelRunner
    params = SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=CountedList([9, 3, 3, 70]))
    checked = checks().check([1, 2], params)
    assert checked.allowed_ids.tolist() == [3, 9, 70]
    req = Request(0, "r", None, [1, 2], params, 0, bad_words_ids=checked.bad_words_ids, allowed_ids=checked.allowed_ids)
    seq = Sequence(1, req, 0, 8)
    runner = types.SimpleNamespace(device="cpu", eos_ids=frozenset({2}))
    runner._static_sampling = types.MethodType(ModelRunner._static_sampling, runner)
    before = CountedList.walks
    for step in range(5):
        batch = ModelRunner._sampling_batch(runner, [seq], np.array([step]))
        logits = torch.zeros(1, 100)
        logits[0, 50] = 10.0                                   # the best token is not allowed
        assert sample(logits, batch).tolist()[0] in (3, 9, 70)
    assert CountedList.walks == before, "the step walked the request's allowed_token_ids list"
