"""No line can end a job, and nothing is silently served with another meaning: hostile request
lines each get a 400 naming the field, good lines around them are served, one row per line in
input order (a property-based fuzz, and one case per problem the issue names)."""
from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, os.path.dirname(__file__))
from hostile_lines import VOCAB, batch  # noqa: E402

from fastdecode.batch.generate import BatchJob  # noqa: E402
from fastdecode.batch.jsonl import parse_line, read_lines  # noqa: E402
from fastdecode.batch.schema import Limits  # noqa: E402
from fastdecode.engine.request_checks import RequestChecks, RequestError, request_bytes  # noqa: E402
from fastdecode.engine.sampling_params import SamplingParams  # noqa: E402


def line(body: dict, url: str = "/v1/completions", cid: str = "x") -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode()


@pytest.mark.parametrize("raw,needle", [
    (line({"prompt": "hi", "temperature": float("nan")}), "temperature must be a finite"),
    (line({"prompt": "hi"}).replace(b'"hi"', b'"hi", "temperature": Infinity'), "temperature must be a finite"),
    (line({"prompt": "hi", "top_k": 2**63}), "top_k must be an integer in"),
    (line({"prompt": "hi", "stop_token_ids": ["5"]}), "stop_token_ids[0] must be an integer, got '5'"),
    (line({"prompt": "hi", "stop_token_ids": [5.7]}), "stop_token_ids[0] must be an integer, got 5.7"),
    (line({"prompt": "hi", "n": 10**8}), "n must be at most 128 (--max-n)"),
    (line({"prompt": "hi", "bad_words": ["w"] * 100_000}), "bad_words must have at most 1024 entries"),
    (line({"messages": [{"role": "robot", "content": "hi"}]}, "/v1/chat/completions"),
     "messages[0].role must be one of 'system', 'user' or 'assistant', got 'robot'"),
    (line({"prompt": "hi"}).replace(b'"hi"', b'"hi", "seed": ' + b"9" * 5000), "not valid JSON"),
    (line({"prompt": "hi"}).replace(b'"hi"', b'"hi", "x": ' + b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
    (line({"prompt": "h\xffi"}).replace("h\\u00ffi".encode(), b"h\xffi"), "not valid JSON in UTF-8"),
    (line({"prompt": "hi"}).replace(b"hi", b"h\ri"), "not valid JSON"),
])
def test_hostile_values_get_a_400_naming_the_problem(raw, needle):
    got = parse_line(7, raw)
    assert got.error is not None and needle in str(got.error), got.error
    assert got.custom_id == "x"           # the row still names the line


def test_limits_are_flags_and_their_rows_are_retried_not_final():
    from fastdecode.batch.resume import DETERMINISTIC_CODES
    wide = Limits(max_n=10**9, max_list_items=200_000)
    assert parse_line(1, line({"prompt": "hi", "n": 500})).error.code == "request_too_large"
    assert parse_line(1, line({"prompt": "hi", "n": 500}), wide).error is None
    assert "request_too_large" not in DETERMINISTIC_CODES      # a rerun with a raised limit serves it


def test_lines_end_at_lf_only_and_overlong_lines_are_skipped_in_bounded_memory(tmp_path):
    path = tmp_path / "in.jsonl"
    long = line({"prompt": "x" * 5000}, cid="long")
    path.write_bytes(line({"prompt": "a\rb"}, cid="cr").replace(b"a\\rb", b"a\rb") + b"\n" + long + b"\n"
                     + line({"prompt": "ok"}, cid="ok") + b"\r\n")
    rows = list(read_lines(str(path), Limits(max_line_bytes=1000)))
    assert [(r.line_no, r.custom_id) for r in rows] == [(1, "cr"), (2, None), (3, "ok")]
    assert "not valid JSON" in str(rows[0].error)             # one row for the CR line, not two
    assert rows[1].error.code == "request_too_large" and rows[2].error is None


def test_the_engine_refuses_what_the_model_or_the_job_bounds():
    checks = RequestChecks(VOCAB, 8192, frozenset({2}), lambda text: [1], max_logprobs=20, max_request_mem=1 << 30)
    with pytest.raises(RequestError, match="stop_token_ids: token id 49159"):
        checks.check([1, 2], SamplingParams(stop_token_ids=[VOCAB + 7], min_tokens=1, max_tokens=4))
    with pytest.raises(RequestError, match="prompt_logprobs must be at most 20") as e:
        checks.check([1, 2], SamplingParams(prompt_logprobs=21))
    assert e.value.code == "request_too_large"
    with pytest.raises(RequestError, match="more than --max-request-mem"):
        checks.check([1] * 100, SamplingParams(n=10**6, max_tokens=4096))
    assert request_bytes(8000, 1, SamplingParams(prompt_logprobs=20)) > 8000 * 9000     # ~9.4 KB per position


def test_sampling_params_never_coerce():
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_k": 2**63},
                {"stop_token_ids": ["5"]}, {"stop_token_ids": [5.7]}, {"n": True}, {"top_p": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=batch(size=32))
def test_a_batch_of_hostile_and_good_lines_is_answered_line_by_line(llm, tmp_path_factory, lines):
    """The job ends normally; one row per line in input order; good lines 200, hostile ones 400."""
    d = tmp_path_factory.mktemp("fuzz")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    inp.write_bytes(b"\n".join(data for data, _, _ in lines) + b"\n")
    with BatchJob(str(inp), str(out)) as job:
        assert not job.run(llm.engine, show_progress=False)
        job.finish(sort=True)
    rows = [json.loads(r) for r in out.read_bytes().splitlines()]
    assert len(rows) == len(lines)
    for row, (data, cid, good) in zip(rows, lines):
        assert row["custom_id"] == cid, (row, data[:200])
        status = row["response"]["status_code"]
        assert status == (200 if good else 400), (status, row.get("error"), data[:300])
