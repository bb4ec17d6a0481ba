"""The layout's rules, checked on the source: what each package may import, no import cycles
between modules, no reaching into another package's private modules, and modules and functions
small enough to read (docs/design.md, "Layout")."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fastdecode", "rworker")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def modules(*packages: str) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the packages."""
    found = {}
    for pkg in packages:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, top_level_only: bool = False,
            runtime_only: bool = False) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every absolute import in the file; function-level
    imports too unless top_level_only; runtime_only leaves out `if TYPE_CHECKING:` blocks (for
    annotations, never executed). The packages use absolute imports only (checked below)."""
    tree = ast.parse(path.read_text())
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(node.module or "." * node.level, a.name, node.lineno) for a in node.names]
    return out


def package_of(module: str) -> str:
    """The package a module belongs to: the module itself for a package's __init__."""
    return module if (REPO / module.replace(".", "/") / "__init__.py").exists() else module.rpartition(".")[0]


ALL = modules(*PACKAGES)


@pytest.mark.parametrize("module", sorted(m for m in ALL if m.startswith("rworker")))
def test_rworker_imports_neither_torch_nor_fastdecode(module):
    """R-worker nodes need only numpy, mpi4py and psutil: no import of torch or fastdecode anywhere
    in rworker/, the protocol package included, not even inside a function."""
    bad = [(m, line) for m, _, line in imports(ALL[module])
           if m.split(".")[0] in ("torch", "fastdecode", "transformers", "triton")]
    assert not bad, f"{ALL[module].relative_to(REPO)} imports {bad}"


def test_importing_every_rworker_module_loads_no_torch():
    names = sorted(m for m in ALL if m.startswith("rworker"))
    code = ("import sys, importlib\n"
            f"for m in {names!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fastdecode'))\n"
            "print(','.join(bad))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"importing rworker loaded {proc.stdout.strip()}"


@pytest.mark.parametrize("module", sorted(ALL))
def test_imports_are_absolute_and_public(module):
    """Absolute imports only (a module's dependencies read the same wherever it lives), and no
    module imports a private module or a private name of another package."""
    own = package_of(module)
    for target, name, line in imports(ALL[module]):
        where = f"{ALL[module].relative_to(REPO)}:{line}"
        assert not target.startswith("."), f"{where}: relative import of {target}"
        if target.split(".")[0] not in PACKAGES:
            continue
        is_module = name is None or f"{target}.{name}" in ALL
        imported = target if name is None or not is_module else f"{target}.{name}"
        if package_of(imported) == own:
            continue
        private = [part for part in imported.split(".") if part.startswith("_") and not part.startswith("__")]
        assert not private, f"{where}: imports {imported}, a private module of another package"
        assert is_module or not name.startswith("_"), f"{where}: imports the private name {name} from {target}"


# fastdecode's wings from the bottom up: a module imports its own wing, the wings below it and the
# foundation, never a wing above (not even inside a function; annotations under TYPE_CHECKING aside).
# The flag definitions shared by the commands sit above the engine they configure; the doors
# (cli.py, llm.py) on top.
WINGS = ("model", "rpart", "sched", "engine", "tp", "options", "batch", "sizing", "sim", "launch", "doors")
OPTIONS = ("fastdecode.engine_options", "fastdecode.flag_ranges", "fastdecode.vllm_args")
FOUNDATION = ("fastdecode.launch.ranks", "fastdecode.launch.omp_binding", "fastdecode.launch.streams")


def wing_of(module: str) -> str:
    if module in OPTIONS:
        return "options"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (REPO / "fastdecode" / parts[-1]).is_dir() else "doors"


FASTDECODE = sorted(m for m in ALL if m.startswith("fastdecode.") and m not in FOUNDATION)


@pytest.mark.parametrize("module", FASTDECODE)
def test_no_wing_imports_a_wing_above_it(module):
    own = WINGS.index(wing_of(module))
    above = []
    for target, name, line in imports(ALL[module], runtime_only=True):
        dep = f"{target}.{name}" if f"{target}.{name}" in ALL else target
        if dep.startswith("fastdecode.") and dep not in FOUNDATION and WINGS.index(wing_of(dep)) > own:
            above.append(f"line {line}: {dep} ({wing_of(dep)})")
    assert not above, f"{ALL[module].relative_to(REPO)} ({wing_of(module)}) imports wings above it: {above}"


@pytest.mark.parametrize("module", FOUNDATION)
def test_the_foundation_imports_nothing_of_fastdecode(module):
    """What every wing may ask (a rank's role, the OpenMP binding, whole lines on stderr)."""
    assert not [t for t, _, _ in imports(ALL[module]) if t.startswith("fastdecode")]


def test_every_wing_is_placed():
    wings = {wing_of(m) for m in FASTDECODE}
    assert wings <= set(WINGS), wings - set(WINGS)


def test_no_import_cycles_between_modules():
    """Not even through a function-level import: a module that imports another inside a function
    to dodge a cycle still depends on it (only annotations under TYPE_CHECKING are left out)."""
    edges = {m: set() for m in ALL}
    for m, path in ALL.items():
        for target, name, _ in imports(path, runtime_only=True):
            dep = f"{target}.{name}" if f"{target}.{name}" in ALL else target
            if dep in ALL and dep != m:
                edges[m].add(dep)
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for dep in sorted(edges[m]):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(trail[trail.index(dep):] + [dep])}"
            if dep not in state:
                visit(dep, trail + [dep])
        state[m] = 2

    for m in sorted(ALL):
        if m not in state:
            visit(m, [m])


def python_sources() -> list[Path]:
    roots = [REPO / p for p in (*PACKAGES, "bench", "scripts", "tests")]
    return sorted(p for r in roots for p in r.rglob("*.py")) + [REPO / "setup.py"]


@pytest.mark.parametrize("path", python_sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_modules_and_functions_stay_small(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{path.relative_to(REPO)}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, \
                f"{path.relative_to(REPO)}:{node.lineno} {node.name} has {length} lines"


def test_one_dtype_table():
    """Bytes per dtype are written in one place (rworker/protocol/kvformat.py)."""
    table = re.compile(r"""["']bf16["']\s*:\s*2\s*[,}]""")          # a bytes entry, not 2.0**-8
    owners = [p.relative_to(REPO) for p in python_sources() if table.search(p.read_text())]
    assert [str(p) for p in owners] == ["rworker/protocol/kvformat.py"], owners
