"""Runtime ISA dispatch for the attention kernels.

setup.py compiles the same C++ source once per ISA into rworker._kernels_{portable,avx2,avx512}.
Importing a module whose instructions the CPU lacks could die with SIGILL at any point, so a module
is imported only after its features were checked (cpuid + the OS's xgetbv, read through the
portable module, which uses baseline instructions only).

    FASTDECODE_ISA=avx512|avx2|portable   force a path; one the CPU cannot run -> ValueError

Test builds: `avx512emu` is the AVX-512 code compiled for AVX2 CPUs through SIMDe (built only
where SIMDe's headers are, e.g. Debian's libsimde-dev). It checks the AVX-512 kernels' logic on
machines without AVX-512, is slow, and is loaded only when asked for by name (EMULATED).
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

# best first; the features each module is compiled for (keep in step with setup.py ISA_FLAGS)
ISAS = ("avx512", "avx2", "portable")
REQUIRED = {
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
EMULATED = {"avx512emu": ("avx2", "fma", "f16c")}   # never dispatched to; KVStore(isa=...) in tests

_modules: dict[str, ModuleType] = {}
_features: frozenset[str] | None = None


def _import(isa: str) -> ModuleType:
    if isa not in _modules:
        try:
            _modules[isa] = importlib.import_module(f"rworker._kernels_{isa}")
        except ImportError as e:
            raise ImportError(
                f"rworker kernel module '{isa}' is not built ({e}); run `python setup.py build_ext --inplace` "
                "or `pip install -e .`"
            ) from e
    return _modules[isa]


def cpu_features() -> frozenset[str]:
    """x86 features this CPU has and the OS enabled (e.g. 'avx2', 'avx512f', 'avx512bf16')."""
    global _features
    if _features is None:
        _features = frozenset(_import("portable").cpu_features())
    return _features


def missing_features(isa: str, features: frozenset[str] | set[str] | None = None) -> list[str]:
    needs = REQUIRED.get(isa, EMULATED.get(isa))
    if needs is None:
        raise ValueError(f"unknown ISA {isa!r}; choose one of {', '.join(ISAS)}")
    have = cpu_features() if features is None else features
    return [f for f in needs if f not in have]


def emulated_isas() -> list[str]:
    """Test builds this CPU can run and this install has (e.g. ['avx512emu'] with SIMDe)."""
    return [i for i in EMULATED if not missing_features(i) and _built(i)]


def _built(isa: str) -> bool:
    try:
        _import(isa)
        return True
    except ImportError:
        return False


def available_isas(features: frozenset[str] | set[str] | None = None) -> list[str]:
    """ISA paths this CPU can run, best first (whether or not their module was built)."""
    return [i for i in ISAS if not missing_features(i, features)]


def choose_isa(requested: str | None = None, features: frozenset[str] | set[str] | None = None) -> str:
    """The ISA to use: `requested` (or $FASTDECODE_ISA) if the CPU supports it, else the best one.

    Raises ValueError naming the missing CPU features when a forced ISA cannot run here."""
    if requested is None:
        requested = os.environ.get("FASTDECODE_ISA", "").strip().lower() or None
    if requested is not None:
        missing = missing_features(requested, features)
        if missing:
            raise ValueError(
                f"ISA '{requested}' was requested (FASTDECODE_ISA or isa=) but this CPU lacks "
                f"{', '.join(missing)}; available: {', '.join(available_isas(features))}"
            )
        return requested
    for isa in available_isas(features):
        if features is not None or _built(isa):
            return isa
    return "portable"


def load(isa: str | None = None) -> ModuleType:
    """The kernel module for `isa` (default: choose_isa()). Never imports one the CPU can't run."""
    return _import(choose_isa(isa))


def selected_isa() -> str:
    """Name of the ISA path that KVStore uses by default here."""
    return choose_isa()
