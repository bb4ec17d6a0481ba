"""scripts/install.sh installs what the documented commands need (matplotlib for `report -o x.png`
and `simulate --plot`) and warns before it installs the CPU build of torch on a machine with an
NVIDIA GPU. Run against a stand-in Python that has nothing installed and logs its pip calls, and
a stand-in nvidia-smi: nothing is installed for real."""
from __future__ import annotations

import os
import stat
import subprocess

from conftest import REPO

FAKE_PYTHON = """#!/bin/bash
# a Python with nothing installed: every import fails, pip calls are logged on stderr
if [[ "$1" == "-m" && "$2" == "pip" ]]; then echo "PIP ${*:3}" >&2; exit 0; fi
if [[ "$1" == "-c" && "$2" == *importlib.util* ]]; then exit 1; fi
exit 1
"""


def executable(path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_install(tmp_path, gpu: bool) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "python", FAKE_PYTHON)
    if gpu:
        executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    path = [str(bin_dir)] + [p for p in os.environ["PATH"].split(os.pathsep)
                             if not os.path.exists(os.path.join(p, "nvidia-smi"))]
    env = dict(os.environ, PYTHON=str(bin_dir / "python"), PATH=os.pathsep.join(path))
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "install.sh")], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.splitlines()


def test_cpu_torch_on_an_nvidia_machine_is_warned_before_and_after(tmp_path):
    lines = run_install(tmp_path, gpu=True)
    torch = next(i for i, line in enumerate(lines) if line.startswith("PIP install") and "torch==" in line)
    warned = [i for i, line in enumerate(lines) if "warning: this machine has an NVIDIA GPU" in line]
    assert warned and warned[0] < torch, lines
    assert "install a CUDA build of torch first" in lines[warned[0]]
    assert "torch is the CPU build on a machine with an NVIDIA GPU" in lines[-1], lines


def test_no_warning_without_a_gpu_and_matplotlib_is_installed(tmp_path):
    lines = run_install(tmp_path, gpu=False)
    assert not any("NVIDIA" in line for line in lines), lines
    assert any(line.startswith("PIP install") and "torch==" in line for line in lines)
    assert any(line.startswith("PIP install") and "matplotlib" in line for line in lines), lines
