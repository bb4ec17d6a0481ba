"""`fastdecode report` and the end-of-run report, on a real short run (local mode): the text
against the output file's own rows, the PNG, the figure's data against the --stats-json rows, and
the errors a user can make (matplotlib missing, a report without statistics)."""
from __future__ import annotations

import json
import re
import struct
from collections import Counter

import pytest
from conftest import batch_line, read_output, run_fastdecode

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    lines = [batch_line("a", {"prompt": "The sky is", "max_tokens": 6, "temperature": 0}),
             batch_line("b", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0},
                        CHAT),
             batch_line("c", {"prompt": "x", "temperature": -1}),                   # a 400
             json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}})]
    inp, out, stats = tmp / "in.jsonl", tmp / "out.jsonl", tmp / "stats.json"
    inp.write_text("\n".join(lines) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--stats-json", str(stats), "--quiet"],
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out, stats, proc


def expected_from_output(out) -> dict:
    """What the report must say, from the output rows themselves."""
    rows = read_output(out)
    ok = [r for r in rows if r["error"] is None]
    return {"ok": len(ok), "codes": Counter(r["error"]["code"] for r in rows if r["error"] is not None),
            "prompt": sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in ok),
            "generated": sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok)}


def expected_bound(stats: dict) -> str:
    """The busier side over the decode steps, from the rows (every step is kept in a short run)."""
    dec = [r for r in stats["steps"] if "s_time_s" in r]
    return "S" if sum(r["s_time_s"] for r in dec) >= sum(r["r_time_max_s"] for r in dec) else "R"


def check_text(text: str, want: dict, bound: str) -> None:
    codes = ", ".join(f"{c} {n}" for c, n in sorted(want["codes"].items()))
    assert re.search(rf"requests: {want['ok']} ok, {sum(want['codes'].values())} error\(s\) \({codes}\)", text), text
    assert f"tokens: {want['prompt']} prompt, {want['generated']} generated" in text, text
    assert re.search(rf"bound: {bound} \(decode steps [\d.]+ s: S-part busy \d+%, busiest R-worker \d+%\)", text), text
    assert re.search(r"time: [\d.]+ s, \d+ steps", text), text


def test_end_of_run_lines_and_text_report(run):
    _, out, stats_path, proc = run
    want, stats = expected_from_output(out), json.loads(stats_path.read_text())
    assert stats["steps_stride"] == 1
    check_text(proc.stderr, want, expected_bound(stats))
    assert proc.stdout.strip().splitlines()[-1].startswith("Throughput: ")
    text = run_fastdecode(["report", str(out) + ".summary.json"], timeout=120)
    assert text.returncode == 0, text.stderr
    check_text(text.stdout, want, expected_bound(stats))
    from_stats = run_fastdecode(["report", str(stats_path)], timeout=120)
    assert from_stats.returncode == 0, from_stats.stderr
    assert f"tokens: {want['prompt']} prompt, {want['generated']} generated" in from_stats.stdout


def test_png_from_the_run_report(run):
    pytest.importorskip("matplotlib")
    tmp, out, _, _ = run
    png = tmp / "run.png"
    proc = run_fastdecode(["report", str(out) + ".summary.json", "-o", str(png)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0 and len(data) > 1000


def test_figure_draws_the_recorded_series(run):
    pytest.importorskip("matplotlib")
    from fastdecode.batch.report_plot import figure
    _, _, stats_path, _ = run
    stats = json.loads(stats_path.read_text())
    rows = stats["steps"]
    dec = [r for r in rows if "s_time_s" in r]
    fig = figure(stats)
    ax = fig.axes
    assert len(ax) == 5
    t = [r["t_s"] for r in rows]
    assert list(ax[0].lines[0].get_xdata()) == t and list(ax[0].lines[0].get_ydata()) == [r["active"] for r in rows]
    assert [list(line.get_ydata()) for line in ax[1].lines] == [[r["kv_tokens"][0] for r in rows]]   # one worker
    assert list(ax[2].lines[0].get_ydata()) == [r["s_time_s"] for r in dec]
    assert list(ax[2].lines[1].get_ydata()) == [r["r_time_max_s"] for r in dec]
    idle = [1 - r["s_time_s"] / (r["step_s"] - r["prefill_s"]) for r in dec]
    assert list(ax[3].lines[0].get_ydata()) == pytest.approx(idle)
    assert list(ax[4].lines[0].get_ydata()) == pytest.approx([r["tokens"] / r["step_s"] for r in rows])
    assert sum(r["tokens"] for r in rows) == stats["summary"]["output_tokens"]


def test_without_matplotlib_it_exits_2_naming_the_extra(run, tmp_path):
    from conftest import REPO
    _, _, stats_path, _ = run
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    proc = run_fastdecode(["report", str(stats_path), "-o", str(tmp_path / "x.png")], timeout=120,
                          env={"PYTHONPATH": f"{fake.parent}:{REPO}"})
    assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr and "fastdecode[plot]" in proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_a_report_without_statistics_says_how_to_get_them(run, tmp_path):
    _, out, _, _ = run
    report = json.loads((out.parent / "out.jsonl.summary.json").read_text())
    report["stats_json"] = None
    path = tmp_path / "no-stats.summary.json"
    path.write_text(json.dumps(report))
    proc = run_fastdecode(["report", str(path), "-o", str(tmp_path / "x.png")], timeout=120)
    assert proc.returncode == 2 and "--stats-json" in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    proc = run_fastdecode(["report", str(bad)], timeout=120)
    assert proc.returncode == 2 and "neither a run report" in proc.stderr
