"""Shared fixtures: the embedded model, an HF transformers reference on the same weights, and a
helper that runs `fastdecode` under `mpiexec` (the tests launch MPI themselves).

MPIEXEC is the launcher of the MPI that mpi4py uses (MPICH's Hydra or Open MPI's mpirun; the
override FASTDECODE_TEST_MPIEXEC wins); what an Open MPI launcher needs (root, oversubscription,
no binding) goes into the environment every child inherits (MPI_ENV)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:          # this checkout's fastdecode, as the children get (PYTHONPATH)
    sys.path.insert(0, REPO)
import fastdecode  # noqa: E402,F401  (its GOMP_SPINCOUNT default, before any test module loads torch)

OVERRIDE = "FASTDECODE_TEST_MPIEXEC"      # a launcher of the tester's choice, used as given


def mpi4py_library(python: str = sys.executable) -> str | None:
    """MPI_Get_library_version of `python`'s mpi4py, asked in a child: no MPI starts in pytest."""
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 and proc.stdout.strip() else None


def launcher_env(flavour: str, root: bool) -> dict[str, str]:
    """What the children's environment needs for this launcher: Open MPI refuses root without
    consent, a rank per core without oversubscription, and binds ranks (MPICH's Hydra does none)."""
    if not flavour.startswith("Open MPI"):
        return {}
    env = {"OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_hwloc_base_binding_policy": "none"}
    if root:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def choose_launcher(library: str | None, override: str | None, which, flavour_of, beside: str,
                    root: bool) -> tuple[str | None, dict[str, str], str | None]:
    """(launcher, its environment additions, why none) for an mpi4py on `library`: the override,
    else the first launcher of the same MPI among those beside the Python, on PATH, and Debian's
    alternatives names. which(name) -> path or None; flavour_of(path) -> info.launcher_flavour's."""
    from fastdecode.launch.info import flavour_family, library_family
    if override:
        path = which(override)
        if path is None:
            return None, {}, f"{OVERRIDE}={override}: no such launcher"
        return path, launcher_env(flavour_of(path), root), None
    family = library_family(library)
    names = {"Open MPI": ("mpirun", "mpiexec", "mpirun.openmpi", "/usr/bin/mpirun.openmpi"),
             "MPICH": ("mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich")}.get(family, ("mpiexec", "mpirun"))
    candidates = [os.path.join(beside, n) for n in names[:2]] + [which(n) for n in names]
    for path in dict.fromkeys(p for p in candidates if p and which(p)):
        flavour = flavour_of(path)
        if family is None or flavour_family(flavour) == family:
            return path, launcher_env(flavour, root), None
    what = f"mpi4py's MPI ({' '.join(library.split()[:3])})" if library else "mpi4py (it does not import)"
    return None, {}, (f"no MPI launcher matches {what}: the multi-rank tests need one of the same MPI. Either "
                      "`pip install mpi4py mpich` (MPICH's mpiexec beside this Python), or use the site's MPI "
                      "with an mpi4py built against it (scripts/openmpi_env.sh builds one for Open MPI; "
                      f"docs/site_mpi.md); {OVERRIDE} names a launcher")


def _which(name: str) -> str | None:
    return name if os.path.isabs(name) and os.access(name, os.X_OK) else shutil.which(name)


def _pick():
    from fastdecode.launch.info import probe_launcher
    override = os.environ.get(OVERRIDE)
    return choose_launcher(None if override else mpi4py_library(), override, _which, probe_launcher,
                           os.path.dirname(sys.executable), os.geteuid() == 0)


# MPIEXEC: the launcher of the MPI that mpi4py uses (a single path; the tests build their command
# lines from it); MPI_ENV: what its ranks' environment needs, set in pytest_configure so that
# every child inherits it; MPIEXEC_ERROR: why there is none
MPIEXEC, MPI_ENV, MPIEXEC_ERROR = _pick()


def pytest_configure(config):
    # Keep the test machine's cache separate from the user's, but shared by all tests of a run.
    os.environ.setdefault("FASTDECODE_CACHE", os.path.join(REPO, ".pytest_cache", "fastdecode-cache"))
    # Engines and R-workers start without the kernel tune (seconds each, a ~1 GB probe): every
    # layout gives the same bits (test_kvstore); tests/test_kernel_tune.py turns it on.
    os.environ.setdefault("FASTDECODE_KERNEL_TUNE", "0")
    config.addinivalue_line("markers", "quick: the unit tests and one end-to-end run per launcher "
                                       "(tests/quick_subset.py; README: Run the tests)")
    for key, value in MPI_ENV.items():
        os.environ.setdefault(key, value)


@pytest.fixture(scope="module")
def llm():
    """The embedded model in fp32 with fp32 KV on the CPU, local mode: comparable with HF's fp32."""
    from fastdecode import LLM
    engine = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smollm_source():
    from fastdecode.model.source import resolve_model
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm(smollm_source):
    """HF transformers' own GGUF loader (its own dequantization and un-permutation): the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(smollm_source.path), os.path.basename(smollm_source.path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return tok, model


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """HF generate, batch of one (no padding), greedy; the new tokens (EOS included if hit)."""
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                             pad_token_id=list(eos_ids)[0])
    return out[0, len(ids):].tolist()


def batch_line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def read_output(path: str) -> dict[str, dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return rows


def run_fastdecode(args: list[str], ranks: int | None = None, timeout: float = 600,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """`fastdecode ...` as a singleton (ranks=None) or under `mpiexec -n ranks`."""
    cmd = [sys.executable, "-m", "fastdecode"] + args
    if ranks is not None:
        if MPIEXEC is None:
            pytest.fail(MPIEXEC_ERROR)
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


def stop_after_rows(args: list[str], ranks: int, out, rows: int, limit_s: float = 300) -> tuple[int, str]:
    """`mpiexec -n ranks fastdecode ARGS`, sent SIGUSR1 (hydra forwards it to every rank) once `out`
    holds `rows` rows (or the job ended); -> (exit code, stderr)."""
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = subprocess.Popen([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "fastdecode"] + args,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + limit_s
    while not (out.exists() and out.read_text().count("\n") >= rows) and job.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=limit_s)
    return job.returncode, err


def write_bound_rows(inp, out, rows, model: str = "smollm2-135m") -> None:
    """Write `rows` to the output `out` of input `inp` as a job serving `model` would: each
    (line number, row dict) with the record binding it to that input line; (None, text) as a line
    of its own without a record (a row edited by hand, another program's, not a row at all)."""
    from fastdecode.batch.jsonl import read_lines
    from fastdecode.batch.output import OutputWriter
    from fastdecode.batch.resume import ResumeIndex
    index = ResumeIndex(model=model)
    try:
        keys = {line.line_no: index.claim(line.line_no, line.custom_id, line.digest).key for line in read_lines(str(inp))}
    finally:
        index.close()
    writer = OutputWriter(str(out), str(inp))
    try:
        for line_no, row in rows:
            if line_no is None:
                writer.f.write(row.encode() + b"\n")
            else:
                writer.write(row, keys[line_no])
    finally:
        writer.close()


def pytest_collection_modifyitems(config, items):
    from quick_subset import mark
    mark(items)                   # `pytest -m quick`: tests/quick_subset.py
