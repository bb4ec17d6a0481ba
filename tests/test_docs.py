"""The docs live in the repo and hold: every command in README.md and docs/ parses (flags, files,
links) and the quick ones run as written (scripts/check_docs.py; `--run` runs them all), the
tuning table names every FASTDECODE_* variable the code reads, and nothing cites a document
outside the repository."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO as _REPO

REPO = Path(_REPO)

TEXT_SUFFIXES = {".py", ".md", ".sh", ".sbatch", ".h", ".cpp", ".toml", ".txt", ".cfg"}


def tracked_text_files() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if any(f.endswith(s) for s in TEXT_SUFFIXES)]


def check_docs(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/check_docs.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_every_documented_command_parses_and_every_link_resolves():
    proc = check_docs()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_documented_command_runs_as_written(tmp_path):
    """Every block of README.md and docs/ that this machine can run (not GPU, SLURM or benchmark
    blocks; the README's pytest command is this suite), in order, in a fresh directory: exit 0."""
    proc = check_docs("--run", "--workdir", str(tmp_path), timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"[1-9]\d* blocks run", proc.stdout), proc.stdout


def test_the_tuning_table_names_every_environment_variable():
    table = (REPO / "docs" / "tuning.md").read_text()
    used = set()
    for f in tracked_text_files():
        used |= set(re.findall(r"FASTDECODE_[A-Z0-9_]+", (REPO / f).read_text(errors="replace")))
    documented = set(re.findall(r"`(FASTDECODE_[A-Z0-9_]+)`", table))
    assert used - documented == set(), f"not in docs/tuning.md: {sorted(used - documented)}"


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_bytes()) < 8 * 1024


def test_no_file_cites_a_document_outside_the_repository():
    outside = "DESIGN" + ".md"           # the design notes this project used to cite by name
    for f in tracked_text_files():
        text = (REPO / f).read_text(errors="replace")
        assert outside not in text, f"{f} cites {outside}; the design lives in docs/design.md"
        urls = [u for u in re.findall(r"https?://[^\s)>\]]+", text)]
        assert not urls, f"{f} links outside the repository: {urls[:3]}"
