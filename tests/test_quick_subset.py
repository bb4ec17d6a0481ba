"""The quick subset: `pytest -m quick` selects the unit tests and one end-to-end run per launcher,
the README offers it below its two set-up commands, and CI still runs the whole suite."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO
from quick_subset import END_TO_END, UNIT_FILES

STARTS_A_JOB = re.compile(r"\bMPIEXEC\b|\bmpiexec\b|\brun_fastdecode\b|\bLLM\(|\bLLMEngine\(|\bsbatch\b")


def collected(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", *args, "tests"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_marker_selects_the_unit_files_and_one_run_per_launcher():
    quick = collected("-m", "quick")
    files = {os.path.basename(t.split("::")[0]) for t in quick}
    assert files == set(UNIT_FILES) | {"test_cli.py", "test_slurm.py"}, files ^ (set(UNIT_FILES) | {"test_cli.py"})
    runs = [t for t in quick if os.path.basename(t.split("::")[0]) in ("test_cli.py", "test_slurm.py")]
    assert sorted(os.path.basename(t).split("[")[0] for t in runs) == sorted(END_TO_END)
    everything = collected()
    assert 1000 < len(quick) < len(everything) * 0.8, (len(quick), len(everything))


def test_the_unit_files_start_no_job():
    for name in UNIT_FILES:
        with open(os.path.join(REPO, "tests", name)) as f:
            found = STARTS_A_JOB.search(f.read())
        assert found is None, f"{name} starts a job ({found.group()}): not a unit-test file of the quick subset"


def test_the_end_to_end_runs_cover_local_mode_mpiexec_and_srun():
    with open(os.path.join(REPO, "tests", "test_cli.py")) as f:
        cli = f.read()
    assert "for ranks in (None, 2, 3)" in cli                  # the fixture the quick runs share
    assert any(t.startswith("test_slurm.py::test_single_one_node_srun") for t in END_TO_END)


def test_the_readme_offers_it_below_the_set_up_commands_and_ci_runs_everything():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert blocks[:2] == ["scripts/install.sh && mpirun -n 3 fastdecode generate -i examples/prompts.jsonl -o out.jsonl\n",
                          "scripts/install.sh --test && python3 -m pytest -q tests\n"]
    assert blocks[2] == "python3 -m pytest -q -m quick tests\n"
    assert "takes minutes" in readme and "The whole suite" in readme       # both durations said
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    assert "scripts/install.sh --test && python3 -m pytest -q tests\n" in ci and "-m quick" not in ci
