"""An output is bound to the input that produced it: each row's request fingerprint is kept
beside it (OUTPUT.fingerprints, never in vLLM's row schema). Reusing an output for another input
is refused; a changed request is served again; a row is never matched by its position; rows that
answer no line are moved to OUTPUT.unmatched.jsonl and counted right."""
from __future__ import annotations

import json

import pytest
from conftest import batch_line, read_output, run_fastdecode
from inprocess import generate

from fastdecode.batch import lock
from fastdecode.batch.binding import ForeignOutput
from fastdecode.cli import UsageError, build_parser, validate_generate


def lines_of(prompts: dict[str, str], max_tokens: int = 3) -> str:
    return "".join(batch_line(cid, {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}) + "\n"
                   for cid, p in prompts.items())


def numbered(n: int, what: str) -> dict[str, str]:
    """request-1 ... request-n: the numbering every batch file starts with."""
    return {f"request-{i}": f"{what} {i}:" for i in range(1, n + 1)}


def validate(argv: list[str]) -> None:
    """The command's checks before any compute, in-process (the lock they take is let go)."""
    try:
        validate_generate(build_parser().parse_args(["generate"] + argv))
    finally:
        lock.release_all()


def test_an_output_of_another_input_with_the_same_ids_is_refused(llm, tmp_path):
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "results.jsonl"
    a.write_text(lines_of(numbered(6, "Cats")))
    b.write_text(lines_of(numbered(6, "Ships")))
    assert generate(llm.engine, ["-i", str(a), "-o", str(out)])[2] == 0
    before = out.read_bytes(), (tmp_path / "results.jsonl.summary.json").read_bytes()
    proc = run_fastdecode(["generate", "-i", str(b), "-o", str(out)], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"output {out} was made from input {a}, not {b}" in proc.stderr
    assert "--overwrite" in proc.stderr and "a new -o" in proc.stderr
    assert (out.read_bytes(), (tmp_path / "results.jsonl.summary.json").read_bytes()) == before
    # --overwrite starts over with the other input
    _, rep, code = generate(llm.engine, ["-i", str(b), "-o", str(out), "--overwrite"])
    assert code == 0 and rep["requests"]["served_this_run"] == 6
    assert [r["custom_id"] for r in read_output(out)] == list(numbered(6, ""))


def test_an_output_with_more_rows_than_the_other_inputs_lines_is_refused(llm, tmp_path):
    big, small, out = tmp_path / "big.jsonl", tmp_path / "small.jsonl", tmp_path / "results.jsonl"
    big.write_text(lines_of(numbered(48, "Item"), max_tokens=1))
    small.write_text(lines_of(numbered(6, "Item"), max_tokens=1))          # the same first 6 lines, another file
    assert generate(llm.engine, ["-i", str(big), "-o", str(out)])[2] == 0
    with pytest.raises(UsageError, match=f"output {out} was made from input {big}, not {small}"):
        validate(["-i", str(small), "-o", str(out)])
    with pytest.raises(ForeignOutput):           # the same refusal where the job opens its output
        generate(llm.engine, ["-i", str(small), "-o", str(out)])
    assert len(read_output(out)) == 48


def test_an_output_without_a_record_of_its_rows_is_refused(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(lines_of(numbered(2, "Hi")))
    out.write_text(json.dumps({"id": "x", "custom_id": "request-1", "response": {"status_code": 200}, "error": None})
                   + "\n")                       # written by another program (vLLM itself, say)
    with pytest.raises(UsageError, match=rf"output {out} holds rows but no record of the requests they answer "
                                         rf"\({out}.fingerprints is missing\)"):
        validate(["-i", str(inp), "-o", str(out)])
    validate(["-i", str(inp), "-o", str(out), "--overwrite"])


def test_the_input_edited_in_place_serves_changed_requests_again_and_moves_their_old_rows(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = numbered(6, "Fact")
    inp.write_text(lines_of(prompts))
    assert generate(llm.engine, ["-i", str(inp), "-o", str(out)])[2] == 0
    first = {r["custom_id"]: r for r in read_output(out)}
    # request-1 reformatted (same request), request-2's prompt and request-5's max_tokens changed,
    # request-6 gone, request-7 new; request-3's row edited by hand
    lines = lines_of(prompts).splitlines()
    lines[0] = json.dumps(json.loads(lines[0]), indent=None, separators=(" ,", " : "), sort_keys=True)
    lines[1] = batch_line("request-2", {"prompt": "A changed question:", "max_tokens": 3, "temperature": 0,
                                        "ignore_eos": True})
    lines[4] = batch_line("request-5", {"prompt": "Fact 5:", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    lines[5] = batch_line("request-7", {"prompt": "Fact 7:", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    inp.write_text("\n".join(lines) + "\n")
    text = out.read_text()
    out.write_text(text.replace(first["request-3"]["id"], "edited-by-hand"))
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    assert code == 0
    rows = read_output(out)
    assert [r["custom_id"] for r in rows] == ["request-1", "request-2", "request-3", "request-4", "request-5",
                                              "request-7"]
    kept = {r["custom_id"] for r in rows if r["custom_id"] in first and r["id"] == first[r["custom_id"]]["id"]}
    assert kept == {"request-1", "request-4"}
    assert rep["requests"]["served_this_run"] == 4 and rep["requests"]["skipped_done_by_earlier_runs"] == 2
    alone = tmp_path / "alone.jsonl"
    (tmp_path / "alone-in.jsonl").write_text(lines[1] + "\n")
    generate(llm.engine, ["-i", str(tmp_path / "alone-in.jsonl"), "-o", str(alone)])
    assert rows[1]["response"]["body"]["choices"][0]["text"] == \
        read_output(alone)[0]["response"]["body"]["choices"][0]["text"]
    assert len(rows[4]["response"]["body"]["choices"][0]["text"]) > 0
    moved = read_output(tmp_path / "out.jsonl.unmatched.jsonl")
    assert sorted(r["id"] for r in moved) == sorted(["edited-by-hand"] + [first[c]["id"] for c in
                                                                         ("request-2", "request-5", "request-6")])
    assert rep["output_file"]["rows_moved"] == 4
    assert rep["output_file"]["moved_by_cause"] == {"unmatched": 3, "unbound": 1}
    assert rep["lines"] == {"input": 6, "answered": 6, "remaining": 0, "ok": 6, "errors": 0}


def test_more_rows_than_lines_are_counted_right_and_moved_not_dropped(llm, tmp_path, capfd):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(lines_of(numbered(48, "Item"), max_tokens=1))
    assert generate(llm.engine, ["-i", str(inp), "-o", str(out)])[2] == 0
    inp.write_text(lines_of(numbered(6, "Item"), max_tokens=1))           # the same file, cut to 6 lines
    capfd.readouterr()
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    err = capfd.readouterr().err
    assert code == 0 and "48 of 6" not in err, err
    assert f"every line of {inp} is already answered in {out} (6 lines)" in err
    assert f"moved 42 row(s) that answer no input line to {out}.unmatched.jsonl (42 answer a request not in " \
           f"the input)" in err, err
    assert rep["lines"]["input"] == 6 and rep["lines"]["answered"] == 6
    assert rep["output_file"]["rows_moved"] == 42
    assert len(read_output(out)) == 6 and len(read_output(tmp_path / "out.jsonl.unmatched.jsonl")) == 42


def test_rows_without_ids_are_never_matched_by_position_across_a_limit_change(llm, tmp_path):
    """Line 1 fits the default --max-line-bytes and is served; at 200 bytes it is too long (an error
    row without a custom_id). Matched by order among rows without ids, it would take line 2's
    stale "missing custom_id" row; bound to its own request, it gets its own answer."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    long_line = batch_line("long", {"prompt": "word " * 60, "max_tokens": 2, "temperature": 0})
    no_id = json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    inp.write_text("\n".join([long_line, no_id, batch_line("c", {"prompt": "Hi", "max_tokens": 2})]) + "\n")
    assert len(long_line) > 200
    assert generate(llm.engine, ["-i", str(inp), "-o", str(out)])[2] == 0
    first = read_output(out)
    assert first[0]["custom_id"] == "long" and first[1]["error"]["code"] == "invalid_request"
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out), "--max-line-bytes", "200"])
    assert code == 0 and rep["output_file"]["moved_by_cause"] == {"unmatched": 1}
    rows = read_output(out)
    assert rows[0]["custom_id"] is None and rows[0]["error"]["code"] == "request_too_large"
    assert "line 1:" in rows[0]["error"]["message"]
    assert rows[1]["id"] == first[1]["id"] and "line 2:" in rows[1]["error"]["message"]     # its own, kept
    assert rows[2]["id"] == first[2]["id"]
    assert [r["custom_id"] for r in read_output(tmp_path / "out.jsonl.unmatched.jsonl")] == ["long"]
