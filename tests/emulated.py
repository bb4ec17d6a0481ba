"""Emulated nodes for the tests (docs/emulated_nodes.md): a cluster of network namespaces that lives
for one test module, a way to run a command over it as MPI ranks (through the same CLI a bench
uses as its launcher prefix), and why none can be made here (the tests skip saying so)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import MPIEXEC, MPIEXEC_ERROR, REPO

CLI = [sys.executable, os.path.join(REPO, "scripts", "emulated_nodes.py")]
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def why_not() -> str | None:
    """Why this machine cannot run the emulated-node tests, or None."""
    if MPIEXEC is None:
        return MPIEXEC_ERROR
    from fastdecode.launch import netns
    from fastdecode.launch.info import probe_launcher
    flavour = probe_launcher(MPIEXEC)
    if not flavour.startswith("MPICH Hydra"):
        return f"the tests' launcher {MPIEXEC} is {flavour}, and emulated nodes start ranks through MPICH Hydra"
    why = netns.unavailable()
    return f"no emulated nodes on this machine: {why}" if why else None


WHY_NOT = why_not()
needs_emulated_nodes = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(CLI + list(args), check=False, capture_output=True, text=True, timeout=60, env=ENV)
    if check and proc.returncode != 0:
        raise AssertionError(f"emulated_nodes.py {' '.join(args)}: {proc.stderr}")
    return proc


class Cluster:
    def __init__(self, name: str, nodes: int):
        self.name, self.nodes = name, nodes

    def launcher(self, ranks: int) -> list[str]:
        """The launcher prefix that runs ranks 0..ranks-1 on nodes 0..ranks-1."""
        return CLI + ["mpiexec", "--name", self.name, "-n", str(ranks)]

    def fastdecode(self, args: list[str], ranks: int) -> list[str]:
        return self.launcher(ranks) + [sys.executable, "-m", "fastdecode"] + args

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO)

    def start(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)

    def counters(self) -> list[dict]:
        """Per node: {"fabric": {"rx", "tx"}, "mgmt": {"rx", "tx"}, ...} (bytes the node received, sent)."""
        return json.loads(cli("counters", "--name", self.name).stdout)["nodes"]

    def shape(self, node: int, *flags: str) -> dict:
        return json.loads(cli("shape", "--name", self.name, "--node", str(node), *flags).stdout)

    def link(self, node: int, state: str) -> None:
        cli("link", "--name", self.name, "--node", str(node), state)


def emulated_cluster(tag: str, nodes: int, *flags: str):
    """A module-scoped fixture: cluster `tag` + this process's pid (unique among concurrent test
    runs), made with the CLI, owned by this process (a crash leaves it to the next `up` to remove),
    removed after the module."""
    @pytest.fixture(scope="module")
    def fixture():
        if WHY_NOT is not None:
            pytest.skip(WHY_NOT)
        name = tag + base36(os.getpid())
        cli("up", "--name", name, "--nodes", str(nodes), "--owner", str(os.getpid()), *flags)
        try:
            yield Cluster(name, nodes)
        finally:
            cli("down", "--name", name, check=False)
    return fixture


def base36(n: int) -> str:
    digits = ""
    while True:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
        if n == 0:
            return digits


def delta(before: list[dict], after: list[dict], node: int, net: str) -> dict[str, int]:
    """Bytes node `node` received and sent on `net` ("fabric", "mgmt") between two readings."""
    return {k: after[node][net][k] - before[node][net][k] for k in ("rx", "tx")}
