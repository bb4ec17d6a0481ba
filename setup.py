"""fastdecode: disaggregated LLM decoding (GPU S-worker, CPU R-workers over MPI).

The attention kernel is compiled once per ISA into its own extension module
(rworker._kernels_<isa>); rworker.isa picks one at import by what the CPU reports,
so a CPU without AVX-512 never executes an AVX-512 instruction (no SIGILL).
"""
import copy
import glob
import os
import platform
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

KERNEL_SOURCES = ["csrc/avx512/kernels.cpp", "csrc/avx512/microbench.cpp"]   # bindings; CPU probes
KERNEL_HEADERS = sorted(glob.glob("csrc/avx512/*.h"))  # rebuild when a header changes
COMMON_FLAGS = ["-O3", "-fno-math-errno", "-std=c++17", "-pthread"]

# isa name -> compiler flags for that module; the source selects code paths by the macros these set.
# rworker/isa.py lists the CPU features each module needs (keep the two in step). AVX512-BF16 is
# not required: Skylake-X/Ice Lake servers have AVX-512 without it and must still get the fast path.
ISA_FLAGS = {"portable": []}
if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
    ISA_FLAGS["avx2"] = ["-mavx2", "-mfma", "-mf16c"]
    ISA_FLAGS["avx512"] = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                         "-Wno-uninitialized", "-Wno-maybe-uninitialized"]  # gcc 12 false alarms in avx512fintrin.h


def simde_include_dir():
    """Where SIMDe's headers are (Debian: libsimde-dev; or $SIMDE_INCLUDE), else None."""
    for d in (os.environ.get("SIMDE_INCLUDE"), "/usr/include", "/usr/local/include", os.path.join(sys.prefix, "include")):
        if d and os.path.exists(os.path.join(d, "simde", "x86", "avx512.h")):
            return d
    return None


# Test-only: the AVX-512 vector layer (csrc/avx512/simd_avx512.h) compiled for AVX2 CPUs through SIMDe (csrc/avx512/simde_avx512.h), so
# its logic is tested where the CPU has no AVX-512. Never chosen by rworker.isa; skipped without SIMDe.
# -O1: its speed means nothing (the module builds in ~20 s on the 2-core dev box).
EMULATED = {}
SIMDE_DIR = simde_include_dir() if "avx2" in ISA_FLAGS else None
if SIMDE_DIR:
    include = [] if SIMDE_DIR in ("/usr/include", "/usr/local/include") else ["-isystem", SIMDE_DIR]
    EMULATED["avx512emu"] = ISA_FLAGS["avx2"] + include + ["-DFD_SIMDE_AVX512", "-O1",
                                                           "-Wno-uninitialized", "-Wno-maybe-uninitialized"]

ext_modules = [
    Pybind11Extension(
        f"rworker._kernels_{isa}",
        KERNEL_SOURCES,
        depends=KERNEL_HEADERS,
        define_macros=[("FD_MODULE_NAME", f"_kernels_{isa}")],
        extra_compile_args=COMMON_FLAGS + flags,
        extra_link_args=["-pthread"],
    )
    for isa, flags in {**ISA_FLAGS, **EMULATED}.items()
]


class BuildPerModule(build_ext):
    """Every module compiles the same KERNEL_SOURCES with its own flags, so each gets its own object
    directory: under `build_ext -j N` they would otherwise race for one kernels.o, and a link then
    fails or takes another module's object."""

    def build_extension(self, ext):
        own = copy.copy(self)                 # parallel builds share self: set build_temp on a copy
        own.build_temp = os.path.join(self.build_temp, ext.name)
        build_ext.build_extension(own, ext)


setup(
    name="fastdecode",
    version="0.1.0",
    description="Throughput-oriented LLM batch decoding with attention disaggregated to CPU R-workers over MPI",
    python_requires=">=3.10",
    packages=find_packages(include=["fastdecode", "fastdecode.*", "rworker", "rworker.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildPerModule},
    install_requires=[
        # R-worker nodes need only these three and pydantic (scripts/install.sh --rworker)
        "numpy>=1.24",
        "mpi4py>=3.1",
        "psutil>=5.9",
        # S-worker side. torch is a range so GPU sites keep their own build; on a CPU
        # machine install torch==2.13.0 first (scripts/install.sh does) or pip fetches a CUDA build.
        "torch>=2.4,<2.15",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "transformers>=4.45",
        "gguf>=0.10",
        "jinja2>=3.1",
        "tqdm>=4.60",
        "pydantic>=2.0",      # batch-file and request schema (fastdecode/batch/schema.py)
    ],
    extras_require={
        # triton: the fused S-part kernels run under its CPU interpreter in the tests (GPU sites
        # already have the triton their torch pins, which satisfies this)
        "test": ["pytest>=7", "hypothesis>=6", "accelerate>=0.30", "matplotlib>=3.7", "numba>=0.59",
                 "triton>=3.0; platform_system == 'Linux'"],
        "bench": ["matplotlib>=3.7", "accelerate>=0.30"],
        "plot": ["matplotlib>=3.7"],        # `fastdecode report -o run.png`
        # `fastdecode simulate`: its event loop compiled (without numba it runs as plain Python,
        # same results, slower on traces of millions of requests)
        "sim": ["numba>=0.59", "matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["fastdecode=fastdecode.cli:main"]},
)
