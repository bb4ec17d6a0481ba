"""The run report keeps every run's figures in its history, and `fastdecode report` renders any
run: the last one even when it found every line answered (no engine, no steps), and an earlier
one with --run N (docs/usage.md, "Progress and reports")."""
from __future__ import annotations

import json

import pytest
from conftest import batch_line, read_output
from inprocess import generate

from fastdecode.batch import report_cmd
from fastdecode.cli import build_parser


def report(argv: list[str], capsys) -> tuple[int, str, str]:
    """`fastdecode report ARGV` in this process -> (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = report_cmd.run(build_parser().parse_args(["report"] + argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def resumed(llm, tmp_path_factory):
    """A job run once, then again finding every line answered: (its summary path, its rows)."""
    tmp = tmp_path_factory.mktemp("noop")
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": 5, "temperature": 0})
                           + "\n" for i in range(3)))
    for _ in range(2):
        _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
        assert code == 0
    assert rep["runs"] == 2 and rep["this_run"]["requests"] == 0 and rep["requests"]["skipped_done_by_earlier_runs"] == 3
    return str(out) + ".summary.json", read_output(str(out))


def tokens_line(rows) -> str:
    usage = [r["response"]["body"]["usage"] for r in rows]
    return (f"tokens: {sum(u['prompt_tokens'] for u in usage)} prompt, "
            f"{sum(u['completion_tokens'] for u in usage)} generated")


def test_report_renders_a_run_that_found_everything_done(resumed, capsys):
    path, _ = resumed
    code, out, err = report([path], capsys)
    assert code == 0, err
    assert "requests: 3 ok, 0 error(s); this run served 0, earlier runs answered 3" in out
    assert "tokens: 0 prompt, 0 generated" in out and "0 steps (0 decoding)" in out
    assert out.strip().splitlines()[-1].startswith("Throughput: ")


def test_the_history_keeps_the_earlier_runs_figures(resumed, capsys):
    path, rows = resumed
    with open(path) as f:
        history = json.load(f)["history"]
    first, noop = history
    assert first["figures"]["output_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows)
    assert first["figures"]["decode_steps"] > 0 and first["figures"]["requests"] == 3
    assert noop["figures"]["steps"] == 0 and noop["figures"]["requests"] == 0
    code, out, err = report([path, "--run", "1"], capsys)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == "run 1 of 2: done" and "requests: 3 served, 0 error(s)" in out
    assert tokens_line(rows) in out and lines[-1].startswith("Throughput: ")


def test_a_run_not_in_the_history_is_named(resumed, capsys):
    path, _ = resumed
    code, _, err = report([path, "--run", "7"], capsys)
    assert code == 2 and "run 7 is not in its history (it lists runs 1-2)" in err
