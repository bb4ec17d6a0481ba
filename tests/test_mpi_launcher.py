"""The launcher and mpi4py's MPI: `fastdecode info` names the launcher's flavour and warns when it
is another MPI than mpi4py's; a job launched by one MPI with mpi4py on another stops at once
naming both and the fixes (exit 2); the tests pick the launcher that matches mpi4py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import MPI_ENV, MPIEXEC, REPO, choose_launcher, launcher_env, mpi4py_library

from fastdecode.launch import info, mpi_env

OPENMPI_4 = "mpirun (Open MPI) 4.1.4\n\nReport bugs to the Open MPI community\n"
OPENMPI_5 = "mpirun (Open MPI) 5.0.3\n\nReport bugs to the Open MPI community\n"
HYDRA = ("HYDRA build details:\n    Version:                                 5.0.2\n"
         "    Release Date:                            unreleased\n    Process Manager:   pmi\n")
INTEL = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\nCopyright 2003-2023\n"
LIB_OMPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"
LIB_MPICH = "MPICH Version:      5.0.2\nMPICH Release date: unreleased\nMPICH ABI:          18:2:6\n"
LIB_INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS\n"
LIB_CRAY = "MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)\n"


@pytest.mark.parametrize("text,flavour", [(OPENMPI_4, "Open MPI 4.1.4"), (OPENMPI_5, "Open MPI 5.0.3"),
                                          (HYDRA, "MPICH Hydra 5.0.2"), (INTEL, "Intel MPI 2021.10"),
                                          ("usage: srun [OPTIONS...]", "unknown"), ("", "unknown")])
def test_launcher_flavour_from_its_version_text(text, flavour):
    assert info.launcher_flavour(text) == flavour


@pytest.mark.parametrize("text,family", [(LIB_OMPI, "Open MPI"), (LIB_MPICH, "MPICH"), (LIB_INTEL, "MPICH"),
                                         (LIB_CRAY, "MPICH"), ("", None), (None, None)])
def test_library_family_from_the_library_version(text, family):
    assert info.library_family(text) == family


def fake_launchers(monkeypatch, flavours: dict[str, str]):
    monkeypatch.setattr(info.shutil, "which", lambda name: f"/opt/bin/{name}" if name in flavours else None)
    monkeypatch.setattr(info, "probe_launcher", lambda path: flavours[os.path.basename(path)])


def test_info_warns_when_the_launcher_is_another_mpi(monkeypatch):
    fake_launchers(monkeypatch, {"mpiexec": "MPICH Hydra 5.0.2", "mpirun": "Open MPI 4.1.4"})
    got = info.launcher_info(LIB_OMPI)
    assert got["mpi_launcher"] == ("mpiexec: MPICH Hydra 5.0.2 (/opt/bin/mpiexec); "
                                   "mpirun: Open MPI 4.1.4 (/opt/bin/mpirun)")
    assert "mpi4py uses Open MPI but mpiexec is MPICH Hydra 5.0.2" in got["mpi_warning"]
    assert "a world of 1" in got["mpi_warning"] and "docs/site_mpi.md" in got["mpi_warning"]
    fake_launchers(monkeypatch, {"mpiexec": "Intel MPI 2021.10"})
    assert "mpi_warning" not in info.launcher_info(LIB_MPICH)          # Hydra's kin launch MPICH ranks
    fake_launchers(monkeypatch, {"mpirun": "unknown"})
    assert "mpi_warning" not in info.launcher_info(LIB_OMPI)           # no guess, no warning
    fake_launchers(monkeypatch, {})
    assert info.launcher_info(LIB_OMPI) == {"mpi_launcher": "none on PATH (mpiexec, mpirun)"}


def test_the_mixed_mpi_message_names_both_libraries_and_the_fixes(tmp_path):
    wheel = tmp_path / "mpi4py"
    wheel.mkdir()
    for abi in ("mpich", "openmpi"):
        (wheel / f"MPI.{abi}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    msg = mpi_env.mixed_mpi_message(None, LIB_MPICH, env={"OMPI_COMM_WORLD_SIZE": "3", "PMIX_RANK": "1"},
                                    origin=str(wheel / "MPI.mpich.cpython-311-x86_64-linux-gnu.so"),
                                    lib_path="/prefix/lib/libmpi.so.12")
    assert msg.startswith("Open MPI's mpirun started 3 ranks (OMPI_COMM_WORLD_SIZE=3), but mpi4py's MPI library "
                          "is MPICH Version: 5.0.2 (/prefix/lib/libmpi.so.12), which cannot start under it")
    assert "launch with MPICH's own mpiexec/mpirun" in msg and "rebuild mpi4py against Open MPI" in msg
    assert "export MPI4PY_MPIABI=openmpi" in msg and "docs/site_mpi.md" in msg

    msg = mpi_env.mixed_mpi_message(1, LIB_OMPI, env={"PMI_SIZE": "3", "PMI_RANK": "0"})
    assert msg.startswith("a Hydra mpiexec (MPICH, Intel MPI) or srun --mpi=pmi2 started 3 ranks (PMI_SIZE=3), "
                          "but mpi4py's MPI library is Open MPI v4.1.4, which sees a world of 1")
    assert "launch with Open MPI's own mpiexec/mpirun" in msg and "rebuild mpi4py against MPICH" in msg
    assert "MPI4PY_MPIABI" not in msg

    msg = mpi_env.mixed_mpi_message(1, LIB_MPICH, env={"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"})
    assert msg.startswith("srun started 4 ranks") and "srun --mpi=pmix or --mpi=pmi2" in msg


# ---------------------------------------------------------------------------- the tests' launcher

PATHS = {"/py/bin/mpiexec": "MPICH Hydra 5.0.2", "/py/bin/mpirun": "MPICH Hydra 5.0.2",
         "/usr/bin/mpirun": "Open MPI 4.1.4", "/usr/bin/mpirun.openmpi": "Open MPI 4.1.4"}


def pick(library, path_names: dict[str, str], root=True, override=None, paths=PATHS):
    which = lambda name: name if name in paths else path_names.get(name)          # noqa: E731
    return choose_launcher(library, override, which, lambda p: paths[p], "/py/bin", root)


def test_the_tests_pick_the_launcher_of_mpi4pys_mpi():
    on_path = {"mpiexec": "/py/bin/mpiexec", "mpirun": "/py/bin/mpirun", "mpirun.openmpi": "/usr/bin/mpirun.openmpi"}
    assert pick(LIB_MPICH, on_path) == ("/py/bin/mpiexec", {}, None)
    path, env, error = pick(LIB_OMPI, on_path)                    # the MPICH shims first on PATH: passed over
    assert (path, error) == ("/usr/bin/mpirun.openmpi", None)
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_hwloc_base_binding_policy": "none"}
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in pick(LIB_OMPI, on_path, root=False)[1]
    assert pick(LIB_OMPI, {"mpirun": "/usr/bin/mpirun"}, paths={"/usr/bin/mpirun": "Open MPI 4.1.4"})[0] == \
        "/usr/bin/mpirun"
    assert pick(LIB_MPICH, {"mpiexec": "/usr/bin/mpirun"}, override="/py/bin/mpirun")[0] == "/py/bin/mpirun"
    assert pick(LIB_MPICH, {}, override="/usr/bin/mpirun")[1]["OMPI_MCA_rmaps_base_oversubscribe"] == "1"


def test_no_matching_launcher_names_both_ways_to_get_one():
    path, env, error = pick(LIB_OMPI, {"mpiexec": "/py/bin/mpiexec"}, paths={"/py/bin/mpiexec": "MPICH Hydra 5.0.2"})
    assert path is None and env == {}
    assert "no MPI launcher matches mpi4py's MPI (Open MPI v4.1.4," in error
    assert "pip install mpi4py mpich" in error and "an mpi4py built against it" in error
    assert "FASTDECODE_TEST_MPIEXEC" in error
    assert "mpi4py (it does not import)" in pick(None, {}, paths={})[2]
    assert pick(LIB_MPICH, {}, override="nonesuch")[2] == "FASTDECODE_TEST_MPIEXEC=nonesuch: no such launcher"


def test_this_runs_launcher_matches_mpi4py_and_its_children_get_its_environment():
    assert MPIEXEC is not None
    family = info.library_family(mpi4py_library())
    if not os.environ.get("FASTDECODE_TEST_MPIEXEC"):
        assert info.flavour_family(info.probe_launcher(MPIEXEC)) == family
    assert MPI_ENV == launcher_env(info.probe_launcher(MPIEXEC), os.geteuid() == 0)
    assert all(os.environ.get(k) == v for k, v in MPI_ENV.items())


# ---------------------------------------------------------------------------- mixed MPIs, end to end

def python_on(family: str) -> str | None:
    """A Python here whose mpi4py is on `family`: this one, its base, or the Open MPI venv."""
    for py in dict.fromkeys([sys.executable, getattr(sys, "_base_executable", sys.executable),
                             os.path.join(REPO, ".venv-openmpi", "bin", "python")]):
        if os.access(py, os.X_OK) and info.library_family(mpi4py_library(py)) == family:
            return py
    return None


def launcher_of(family: str) -> tuple[str | None, dict]:
    from conftest import _which
    library = LIB_OMPI if family == "Open MPI" else LIB_MPICH
    path, env, _ = choose_launcher(library, None, _which, info.probe_launcher, os.path.dirname(sys.executable),
                                   os.geteuid() == 0)
    return path, env


@pytest.mark.parametrize("launcher_family,python_family,needle", [
    ("Open MPI", "MPICH", "Open MPI's mpirun started 3 ranks (OMPI_COMM_WORLD_SIZE=3), but mpi4py's MPI library "
                          "is MPICH"),
    ("MPICH", "Open MPI", "a Hydra mpiexec (MPICH, Intel MPI) or srun --mpi=pmi2 started 3 ranks (PMI_SIZE=3), "
                          "but mpi4py's MPI library is Open MPI"),
])
def test_a_job_launched_by_another_mpi_stops_at_once_naming_both(tmp_path, launcher_family, python_family, needle):
    launcher, env = launcher_of(launcher_family)
    python = python_on(python_family)
    if launcher is None or python is None:
        pytest.skip(f"needs a {launcher_family} launcher and a Python with mpi4py on {python_family} "
                    "(scripts/openmpi_env.sh)")
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                                       '"body": {"prompt": "Hi", "max_tokens": 2}}\n')
    full_env = {**os.environ, **env, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([launcher, "-n", "3", python, "-m", "fastdecode", "generate", "-i", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120,
                          env=full_env, cwd=REPO)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.count(needle) == 1, proc.stderr[-3000:]
    assert "the launcher and mpi4py must be the same MPI" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()                   # no rank went on alone
