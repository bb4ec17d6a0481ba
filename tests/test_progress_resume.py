"""Progress after a resume is the job's: the earlier runs' rows and the saved tokens a run
continues count as done, the total is the whole input's, and neither counts in tok/s or the ETA
(docs/usage.md, "Progress and reports")."""
from __future__ import annotations

import io
import json

import pytest
from conftest import batch_line
from inprocess import Borrowed, StepStop, generate
from test_progress import progress_lines

from fastdecode.batch.generate import run_generate
from fastdecode.batch.progress import Progress, Snapshot
from fastdecode.cli import build_parser

LINES, MAX_TOKENS, BATCH = 40, 16, 8


@pytest.fixture(scope="module")
def small_batch():
    """An engine of 8 slots: the 40 lines run in waves."""
    from fastdecode import LLM
    engine = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", max_batch=BATCH)
    yield engine
    engine.close()


def write_job(path) -> None:
    path.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": MAX_TOKENS,
                                                 "temperature": 0, "ignore_eos": True}) + "\n"
                            for i in range(LINES)))


def run_shown(engine, argv: list[str], capsys) -> str:
    """A run on `engine` with its progress lines (every 10 ms) -> its stderr."""
    args = build_parser().parse_args(["generate", "--progress-interval", "0.01"] + argv)
    stop = StepStop(None)

    def make_engine():
        stop.attach(engine)
        return Borrowed(engine)
    capsys.readouterr()
    _, _, code = run_generate(make_engine, args, stop)
    assert code == 0
    return capsys.readouterr().err


def test_a_resumed_run_counts_the_earlier_rows_and_the_continued_tokens(small_batch, tmp_path, capsys):
    """Stopped in the third wave of 8 (16 rows written, 8 sequences saved mid-way): the rerun's
    lines count the 16 rows' tokens and the saved ones as done, of the job's 40 x 16."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_job(inp)
    args = ["-i", str(inp), "-o", str(out)]
    _, rep, code = generate(small_batch.engine, args, stop_at=2 * MAX_TOKENS + 4)
    assert code == 75
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    earlier = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows)
    saved = rep["this_run"]["saved_in_flight_tokens"]
    assert earlier > 0 and saved > 0
    lines = progress_lines(run_shown(small_batch.engine, args, capsys))
    job = LINES * MAX_TOKENS
    assert all(int(m["expected"]) == job for m in lines), [m.group(0) for m in lines]
    first = lines[0]
    assert int(first["done"]) >= earlier + saved, first.group(0)
    assert float(first["pct"]) >= 100 * (earlier + saved) / job - 0.1
    assert lines[-1]["state"] == " done" and int(lines[-1]["done"]) == job


def test_the_rate_counts_only_this_runs_tokens():
    """5,000 tokens done before the run, 10 a second since: tok/s is 10, and the ETA prices the
    1,000 left at that rate, not at 5,000 in the first interval."""
    now = [0.0]
    stream = io.StringIO()
    progress = Progress(lambda: Snapshot(5000 + int(10 * now[0]), 6000, 0, 4, 1, 0, [10], [100], tokens_before=5000),
                        interval=1e-9, stream=stream, clock=lambda: now[0])
    for t in (1.0, 2.0, 4.0):
        now[0] = t
        progress.update()
    last = progress_lines(stream.getvalue())[-1]
    assert float(last["rate"]) == 10.0 and last["done"] == "5040"
    assert last["eta"] == "0:01:36"          # 960 tokens left at 10/s
