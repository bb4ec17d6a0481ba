"""The command line's habits: vllm run-batch's flag names, a typo named with the closest flag,
--version, real defaults in plan's help, bad FASTDECODE_* values refused on every rank before
any compute, --quiet R-worker roster, and a rerun that finds every line answered."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MPIEXEC, REPO, batch_line, run_fastdecode

from fastdecode.cli import build_parser
from fastdecode.launch.env_vars import CHECKS, environment_errors


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------------- flags

def test_vllm_run_batch_flag_names_work():
    # vllm run-batch: -i/--input-file, -o/--output-file
    args = parse(["generate", "--input-file", "in.jsonl", "--output-file", "out.jsonl"])
    assert (args.input, args.output) == ("in.jsonl", "out.jsonl")
    args = parse(["generate", "-i", "a.jsonl", "--output-file=b.jsonl"])
    assert (args.input, args.output) == ("a.jsonl", "b.jsonl")


def test_a_typo_is_named_with_the_closest_flag_not_as_a_missing_one(capsys):
    err = usage_error(["generate", "--inptu", "x.jsonl", "-o", "y.jsonl"], capsys)
    assert "unrecognized arguments: --inptu x.jsonl; did you mean --input?" in err, err
    assert "required" not in err
    err = usage_error(["generate", "-i", "x", "-o", "y", "--max-bacth", "3", "--quite"], capsys)
    assert "--max-bacth: did you mean --max-batch?" in err and "--quite: did you mean --quiet?" in err, err
    err = usage_error(["plan", "--contxt", "5"], capsys)
    assert "did you mean --context?" in err, err


def test_a_missing_required_flag_is_still_named(capsys):
    err = usage_error(["generate", "--input-file", "x.jsonl"], capsys)
    assert "the following arguments are required: -o/--output/--output-file" in err, err


def test_version_is_the_package_version():
    proc = run_fastdecode(["--version"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"fastdecode {importlib.metadata.version('fastdecode')}"


def test_plan_help_states_the_real_defaults():
    plan = build_parser().commands["plan"]
    text = " ".join(plan.format_help().split())           # argparse wraps lines
    assert "(default: None)" not in text and "(default: False)" not in text
    defaults = parse(["plan"])
    for flag, dest in (("--context", "context"), ("--prompt-len", "prompt_len"), ("--cpu-eff", "cpu_eff"),
                       ("--pipeline-depth", "pipeline_depth"), ("--kv-reserve", "kv_reserve")):
        value = getattr(defaults, dest)
        assert value is not None and f"(default: {value})" in text, (flag, value)
    from fastdecode.sizing.hardware_options import STATED_CPU_MEM_GB, STATED_LINK_BW_GBPS
    assert f"stated hardware: {STATED_CPU_MEM_GB:g} GB less 10%)" in text
    assert f"stated hardware: {STATED_LINK_BW_GBPS:g})" in text


# ---------------------------------------------------------------------------- FASTDECODE_* values

def documented_values() -> dict[str, list[str]]:
    """docs/tuning.md's table: each variable's listed values (backquoted, defaults included)."""
    out = {}
    for row in (Path(REPO) / "docs" / "tuning.md").read_text().splitlines():
        cells = [c.strip() for c in row.split("|")[1:-1]]
        if len(cells) == 4 and re.fullmatch(r"`FASTDECODE_[A-Z0-9_]+`", cells[0]):
            out[cells[0].strip("`")] = [v for v in re.findall(r"`([^`]*)`", cells[1]) if "<" not in v]
    return out


def test_every_documented_value_passes_and_a_wrong_one_is_named():
    documented = documented_values()
    assert set(CHECKS) <= set(documented)
    for name in CHECKS:
        for value in documented[name]:
            assert environment_errors(False, {name: value}) == [], (name, value)
        errors = environment_errors(False, {name: "bogus-value"})
        assert len(errors) == 1 and errors[0].startswith(f"{name}='bogus-value': expected"), errors
    assert environment_errors(False, {name: "" for name in CHECKS}) == []             # empty = unset


def test_a_bad_environment_value_exits_2_before_compute(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi", "max_tokens": 2}) + "\n")
    t0 = time.time()
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl")], timeout=60,
                          env={"FASTDECODE_WAIT": "slep"})
    assert proc.returncode == 2, proc.stderr
    assert "fastdecode: error: FASTDECODE_WAIT='slep': expected one of adaptive, spin, sleep" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists() and time.time() - t0 < 30


def test_a_bad_value_on_some_ranks_ends_every_rank_with_2(tmp_path):
    """Ranks 1 and 2 get FASTDECODE_PIN=yes, rank 0 none: the job ends with 2, rank 0 names them."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi", "max_tokens": 2}) + "\n")
    cmd = [sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl")]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([MPIEXEC, "-n", "1", *cmd, ":", "-n", "2", "-env", "FASTDECODE_PIN", "yes", *cmd],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fastdecode: error:")]
    assert errors == ["fastdecode: error: ranks 1, 2: FASTDECODE_PIN='yes': expected one of 0, 1"], proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------------- --quiet, and a rerun with nothing to do

def test_quiet_then_a_rerun_that_finds_every_line_answered(tmp_path):
    """Under mpiexec -n 3: --quiet prints no R-worker roster; the rerun (not quiet) reads the output
    before the model loads, says every line is answered and ends 0 without an engine: no R-worker
    starts (no roster, which rank 0 prints once the R-workers have started and tuned)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count {i}", "max_tokens": 3, "temperature": 0}) + "\n"
                           for i in range(4)) + "{not json\n")
    first = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], ranks=3, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "R-worker pid" not in first.stderr and "Throughput:" in first.stdout, first.stderr[-2000:]
    rows = out.read_bytes()
    again = run_fastdecode(["generate", "-i", str(inp), "-o", str(out)], ranks=3, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"every line of {inp} is already answered in {out} (5 lines); nothing to do" in again.stderr
    assert "R-worker pid" not in again.stderr and "Throughput:" not in again.stdout, again.stderr[-2000:]
    assert out.read_bytes() == rows
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "done" and report["runs"] == 2 and report["exit_code"] == 0
    assert report["requests"]["skipped_done_by_earlier_runs"] == 5 and report["lines"]["remaining"] == 0


def test_a_rerun_whose_output_has_enough_rows_but_not_every_line_serves_the_rest(tmp_path):
    """Rows of another input make the output as long as the input while one line is unanswered:
    the early check reads the lines, finds it, and the run serves that line once (no line is
    taken as a duplicate of itself), moving the foreign rows (no record binds them) aside."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"

    def lines(ids):
        return "".join(batch_line(i, {"prompt": f"Say {i}", "max_tokens": 2, "temperature": 0}) + "\n" for i in ids)
    inp.write_text(lines(["a", "b"]))
    assert run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300).returncode == 0
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    foreign = [json.dumps({**r, "custom_id": f"other-{r['custom_id']}"}) + "\n" for r in rows]
    out.write_text(out.read_text() + "".join(foreign))
    inp.write_text(lines(["a", "b", "c"]))
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert proc.returncode == 0 and "already answered" not in proc.stderr, proc.stderr[-2000:]
    final = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["custom_id"] for r in final] == ["a", "b", "c"]
    assert all(r["response"]["status_code"] == 200 for r in final)
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["requests"]["served_this_run"] == 1 and report["requests"]["skipped_done_by_earlier_runs"] == 2
    assert report["output_file"]["rows_moved"] == 2 and report["output_file"]["moved_by_cause"] == {"unbound": 2}


def test_each_message_has_one_prefix(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi", "max_tokens": 2}) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl")], timeout=300,
                          env={"FASTDECODE_INJECT_FAULT": "0:step"})
    assert proc.returncode == 1 and "fastdecode: failed: InjectedFault: injected fault at step" in proc.stderr, \
        proc.stderr[-2000:]
    assert not re.search(r"fastdecode: (fastdecode|error: fastdecode)", proc.stderr), proc.stderr[-2000:]
