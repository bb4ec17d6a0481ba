"""ISA dispatch: feature detection, forced paths, clear errors instead of SIGILL; thread defaults."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from rworker import available_isas, cpu_features, selected_isa
from rworker import isa as isa_mod
from rworker.host.threads import cpu_set, default_threads, physical_cpus, pin_cpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_features_and_choice_consistent():
    feats = cpu_features()
    assert isinstance(feats, frozenset)
    if X86:
        assert "sse2" in feats
    isas = available_isas()
    assert isas[-1] == "portable"
    forced = os.environ.get("FASTDECODE_ISA", "").strip().lower()
    assert selected_isa() == (forced or isas[0])   # best path the CPU runs (all are built here)
    for name in isas:
        assert isa_mod.load(name).ISA == name


def test_missing_feature_is_a_clear_value_error(monkeypatch):
    monkeypatch.delenv("FASTDECODE_ISA", raising=False)
    avx2_only = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
    with pytest.raises(ValueError, match="avx512f"):
        isa_mod.choose_isa("avx512", features=avx2_only)
    with pytest.raises(ValueError, match="avx2"):
        isa_mod.choose_isa("avx2", features=frozenset({"sse2"}))
    with pytest.raises(ValueError, match="unknown ISA"):
        isa_mod.choose_isa("sse9", features=avx2_only)
    assert isa_mod.choose_isa(None, features=avx2_only) in ("avx2",)
    assert isa_mod.choose_isa(None, features=frozenset()) == "portable"
    assert isa_mod.available_isas(frozenset({"sse2"})) == ["portable"]
    # no BF16 dot-product extension needed (Skylake-X / Ice Lake servers keep the AVX-512 path)
    skx = avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert isa_mod.choose_isa(None, features=skx) == "avx512"


def _run(env_isa: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTDECODE_ISA=env_isa, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_forced_portable_in_subprocess():
    code = (
        "import numpy as np, rworker, sys\n"
        "from rworker import KVStore\n"
        "s = KVStore(1, 1, 64, 'bf16', threads=2)\n"
        "z = np.ones((70, 1, 64), np.float32)\n"
        "s.append(0, [0] * 70, z, z)\n"
        "o = s.attend(0, [0], np.ones((1, 2, 64), np.float32))\n"
        "assert np.allclose(o, 1.0)\n"
        "assert 'rworker._kernels_avx512' not in sys.modules and 'rworker._kernels_avx2' not in sys.modules\n"
        "print(s.isa, rworker.selected_isa())\n"
    )
    r = _run("portable", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["portable", "portable"]


def test_forced_unknown_or_unsupported_isa_in_subprocess():
    r = _run("avx1024", "from rworker import KVStore; KVStore(1, 1, 64)")
    assert r.returncode != 0 and "ValueError" in r.stderr and "unknown ISA" in r.stderr
    missing = [i for i in ("avx512", "avx2") if i not in available_isas()]
    for name in missing:                          # only on hosts without it: must not SIGILL
        r = _run(name, "from rworker import KVStore; KVStore(1, 1, 64)")
        assert r.returncode == 1 and "ValueError" in r.stderr and "lacks" in r.stderr


def test_thread_defaults():
    cpus = cpu_set()
    phys = physical_cpus()
    assert 1 <= len(phys) <= len(cpus) and set(phys) <= set(cpus)
    old = os.environ.pop("FASTDECODE_THREADS", None)
    try:
        assert default_threads() == len(phys)
        os.environ["FASTDECODE_THREADS"] = "3"
        assert default_threads() == 3
        os.environ["FASTDECODE_THREADS"] = "zero"
        with pytest.raises(ValueError):
            default_threads()
    finally:
        os.environ.pop("FASTDECODE_THREADS", None)
        if old is not None:
            os.environ["FASTDECODE_THREADS"] = old
    pins = pin_cpus(len(phys))
    assert pins == phys or os.environ.get("FASTDECODE_PIN") == "0"


@pytest.mark.skipif(not X86, reason="x86 ISA modules only")
def test_modules_contain_only_their_isa():
    """The portable module has no AVX at all, the AVX2 module no AVX-512 (what makes the CPU check
    before import sufficient to never SIGILL)."""
    import shutil

    if shutil.which("objdump") is None:
        pytest.skip("objdump not installed")
    forbidden = {"portable": ("ymm", "zmm"), "avx2": ("zmm",), "avx512emu": ("zmm",)}   # emu: SIMDe on AVX2
    for name, regs in forbidden.items():
        mod = isa_mod.load(name) if name in available_isas() + isa_mod.emulated_isas() else None
        if mod is None:
            continue
        asm = subprocess.run(["objdump", "-d", mod.__file__], capture_output=True, text=True, timeout=120).stdout
        assert asm, f"objdump produced nothing for {mod.__file__}"
        for reg in regs:
            assert f"%{reg}" not in asm, f"{name} module uses {reg} registers"
