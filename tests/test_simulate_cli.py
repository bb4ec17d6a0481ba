"""`fastdecode simulate` end to end (JSON and PNG), its trace files and their errors, and the
numba-compiled event loop against the plain-Python one."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fastdecode.cli import main
from fastdecode.sim.core import SimConfig, simulate
from fastdecode.sim.costs import costs_of
from fastdecode.sim.trace import TraceError, load_trace, synthetic_trace
from fastdecode.sizing.hardware import GPU_PRESETS, stated_profile
from fastdecode.sizing.schema import MODEL_PRESETS

STATED = ["--model", "smollm2-135m", "--gpu-profile", "h100", "--cpu-bw", "20"]


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_trace_formats_and_aliases(tmp_path):
    rows = [{"prompt_len": 5, "output_len": 3, "max_tokens": 8, "arrival_s": 1.5},
            {"prompt_tokens": 7, "completion_tokens": 2}]
    jsonl = load_trace(write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n"))
    listed = load_trace(write(tmp_path, "t.json", json.dumps(rows, indent=1)))
    wrapped = load_trace(write(tmp_path, "w.json", json.dumps({"requests": rows}, indent=2)))
    for t in (jsonl, listed, wrapped):
        assert t.prompt_len.tolist() == [5, 7] and t.output_len.tolist() == [3, 2]
        assert t.max_tokens.tolist() == [8, 2] and t.arrival_s.tolist() == [1.5, 0.0]


@pytest.mark.parametrize("text, message", [
    ('{"prompt_len": 5}\n', "t.jsonl:1: missing output_len"),
    ('{"prompt_len": 5, "output_len": 2}\n{"prompt_len": 0, "output_len": 2}\n', "t.jsonl:2: prompt_len must be"),
    ('{"prompt_len": 5, "output_len": 2.5}\n', "output_len must be an integer"),
    ('{"prompt_len": 5, "output_len": 4, "max_tokens": 3}\n', "t.jsonl:1: max_tokens 3 is below output_len 4"),
    ('{"prompt_len": 5, "output_len": 4, "arrival_s": -1}\n', "arrival_s must be a number >= 0"),
    ('{"prompt_len": 5, "output_len": 4}\n{"prompt_len": 5,\n', "t.jsonl:2: not valid JSON"),
    ('[{"prompt_len": 5, "output_len": 4}, 3]', "request 1: expected an object"),
    ('\n\n', "no requests"),
])
def test_trace_errors_name_the_file_line_and_field(tmp_path, text, message):
    with pytest.raises(TraceError, match=message.replace(".", r"\.")):
        load_trace(write(tmp_path, "t.jsonl", text))


def test_missing_trace_and_bad_distributions_are_named(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace .*nope.jsonl"):
        load_trace(str(tmp_path / "nope.jsonl"))
    for spec in ("uniform:9:3", "lognormal:0:1", "gauss:3:1", "12.5", "x"):
        with pytest.raises(TraceError, match="--prompt-len"):
            synthetic_trace(4, spec, "8")


def test_distributions_draw_what_they_say():
    t = synthetic_trace(4000, "uniform:10:20", "lognormal:100:0.5", max_tokens=150, rate=50.0, seed=1)
    assert t.prompt_len.min() == 10 and t.prompt_len.max() == 20
    assert t.output_len.max() == 150 and (t.max_tokens == 150).all()
    uncapped = synthetic_trace(4000, "8", "lognormal:100:0.5", seed=1).output_len
    assert uncapped.mean() == pytest.approx(100, rel=0.05)
    assert np.diff(t.arrival_s).mean() == pytest.approx(1 / 50, rel=0.1)


def test_numba_and_plain_python_give_identical_runs():
    pytest.importorskip("numba")
    prof = stated_profile(GPU_PRESETS["a10"], MODEL_PRESETS["llama-2-7b"], 40.0, 64.0, link_bw_GBps=1.0)
    trace = synthetic_trace(300, "uniform:16:300", "lognormal:60:0.8", max_tokens=200, rate=40.0, seed=4)
    runs = []
    for use_numba in (True, False):
        cfg = SimConfig(rworkers=3, depth=2, schedule="stabilized", max_batch=96, use_numba=use_numba)
        runs.append(simulate(costs_of(prof, 3, 96), trace, cfg))
    a, b = runs
    assert a.steps.keys() == b.steps.keys()
    for key in a.steps:
        assert np.array_equal(a.steps[key], b.steps[key]), key
    assert np.array_equal(a.gap_s, b.gap_s) and np.array_equal(a.finish_s, b.finish_s)


def test_cli_writes_json_and_png(tmp_path, capsys):
    trace = write(tmp_path, "t.jsonl", "".join(json.dumps({"prompt_len": 20 + i, "output_len": 5 + i % 7,
                                                           "max_tokens": 12}) + "\n" for i in range(40)))
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["simulate", *STATED, "--trace", trace, "--rworkers", "2", "--max-batch", "16",
                 "--schedule", "stabilized", "-o", str(out), "--plot", str(png)]) == 0
    assert "tokens/s" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["output_tokens"] == sum(5 + i % 7 for i in range(40)) and s["requests_finished"] == 40
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"], rel=1e-3)
    assert 0 < s["token_latency_p50_s"] <= s["token_latency_p99_s"]
    assert len(s["utilisation"]["r_workers"]) == 2 and doc["timeline"] and doc["steps"]
    assert doc["setting"]["schedule"] == "stabilized" and doc["admission"]["schedule"] == "stabilized"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_takes_a_profile_and_plans_flags(tmp_path, capsys):
    prof = stated_profile(GPU_PRESETS["h100"], MODEL_PRESETS["smollm2-135m"], 20.0, 8.0)
    path = write(tmp_path, "p.json", prof.to_json())
    argv = ["simulate", "--profile", path, "--requests", "30", "--prompt-len", "64", "--output-len", "16", "--json"]
    assert main(argv) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(argv + ["--cpu-bw", "2"]) == 0                 # a what-if on the profile, as plan takes it
    slower = json.loads(capsys.readouterr().out)
    assert slower["output_tokens"] == base["output_tokens"] == 30 * 16
    assert slower["output_tokens_per_s"] < base["output_tokens_per_s"]


@pytest.mark.parametrize("argv, message", [
    (["--trace", "/nonexistent/t.jsonl"], "cannot read trace /nonexistent/t.jsonl"),
    (["--prompt-len", "uniform:5"], "--prompt-len"),
    (["--link-bw", "-1"], "--link-bw must be a finite number > 0"),
])
def test_cli_errors_exit_2_naming_the_input(capsys, argv, message):
    assert main(["simulate", *STATED, *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_without_hardware_says_what_is_missing(capsys):
    assert main(["simulate", "--requests", "4"]) == 2
    assert "missing --gpu-profile --model --cpu-bw" in capsys.readouterr().err
