"""The S/R pipeline and its transport: identical tokens at every depth, the bytes on the wire
match the formula, and a rank that dies or hangs mid-step ends the job naming it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import MPIEXEC, REPO, batch_line, run_fastdecode
from test_hf_parity import run_ids

REQUESTS = (
    [{"prompt": f"Story {i}: " + "once more " * (i * 7 % 40), "params": {"max_tokens": 20 + i % 9,
                                                                          "temperature": 0}}
     for i in range(14)]
    + [{"prompt": f"Random {i}", "params": {"max_tokens": 16, "temperature": 0.9, "seed": i}} for i in range(6)]
)


@pytest.mark.parametrize("ranks", [None, 3], ids=["local", "mpi-n3"])
def test_depths_give_identical_tokens(tmp_path, ranks, monkeypatch):
    import test_hf_parity
    results = {}
    for depth in (1, 2, 3):
        monkeypatch.setattr(test_hf_parity, "ENGINE", {**test_hf_parity.ENGINE, "pipeline_depth": depth})
        (tmp_path / f"d{depth}").mkdir()
        results[depth] = run_ids(tmp_path / f"d{depth}", REQUESTS, ranks)["outputs"]
    assert results[2] == results[1]
    assert results[3] == results[1]
    assert len({len(o[0]) for o in results[1]}) > 3          # varied lengths: mini-batches change over time


@pytest.mark.parametrize("depth", [1, 2])
def test_bytes_on_the_wire_match_the_formula(depth):
    """Per token per layer: (Hq + 2 Hkv) D out and Hq D back; prompts ship 2 Hkv D per token per layer."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([MPIEXEC, "-n", "3", sys.executable, os.path.join(REPO, "tests", "mpi_scripts",
                                                                          "byte_count.py"), str(depth)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    per_row_out = (r["hq"] + 2 * r["hkv"]) * r["d"] * r["itemsize"] * r["layers"]
    per_row_back = r["hq"] * r["d"] * r["itemsize"] * r["layers"]
    per_prompt_token = 2 * r["hkv"] * r["d"] * r["itemsize"] * r["layers"]
    assert r["decode_rows"] > 0 and r["prefill_rows"] > 0
    assert r["sent"] == r["decode_rows"] * per_row_out + r["prefill_rows"] * per_prompt_token
    assert r["received"] == r["decode_rows"] * per_row_back


def _lines(tmp_path, n=6):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(batch_line(f"r{i}", {"prompt": f"Hello number {i}", "max_tokens": 40,
                                                  "temperature": 0}) for i in range(n)) + "\n")
    return inp


@pytest.mark.parametrize("how,death", [("exit", "exited with code 17"), ("kill", "killed by SIGKILL")])
def test_a_rank_that_dies_mid_step_ends_the_job_and_the_report_names_it(tmp_path, how, death):
    """Rank 1 ends without a word (an exit, or SIGKILL as the OOM killer sends): its supervisor
    names it, rank 0's report says failed naming it before the job ends, and the job exits 1
    (rank 0 aborts it: not the launcher's code for a killed process)."""
    inp = _lines(tmp_path)
    out = tmp_path / "out.jsonl"
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out)], ranks=3, timeout=120,
                          env={"FASTDECODE_INJECT_FAULT": f"1:decode:{how}"})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    roster = re.search(r"rank 1 = R-worker pid (\d+)", proc.stderr)          # without --quiet: the roster
    assert roster, proc.stderr[-2000:]
    named = f"rank 1 (R-worker pid {roster.group(1)} on"
    assert named in proc.stderr and f"died: {death}" in proc.stderr, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["failed_rank"] == 1 and report["exit_code"] == 1, report
    assert named in report["error"] and death in report["error"], report["error"]


def test_a_rank_that_hangs_is_named_and_the_job_ends_for_requeue(tmp_path):
    inp = _lines(tmp_path)
    out = tmp_path / "out.jsonl"
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--timeout", "5"], ranks=3,
                          timeout=180, env={"FASTDECODE_INJECT_FAULT": "2:decode:hang"})
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-2000:])
    assert "no reply from rank 2 (R-worker" in proc.stderr
