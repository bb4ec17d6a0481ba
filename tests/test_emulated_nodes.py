"""Emulated nodes (fastdecode/launch/netns.py, scripts/emulated_nodes.py): ranks in network
namespaces of their own send the same tokens as over shared memory, and the transport's bytes
really cross each node's fabric link (its veth's counters), not the management network."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import MPIEXEC, REPO
from emulated import CLI, ENV, cli, delta, emulated_cluster, needs_emulated_nodes

from fastdecode.launch import netns_links as links

SCRIPT = os.path.join(REPO, "tests", "mpi_scripts", "link_bytes.py")
N_PROMPTS, MAX_TOKENS = 6, 8
# Wire overhead, per byte: each full TCP segment (MSS 1448 on a 1500-byte MTU: 1500 - 20 IPv4 - 32
# TCP with time stamps) carries 66 bytes of headers (14 Ethernet + 20 IPv4 + 32 TCP), and the
# other direction's segments are answered by at most one 66-byte ACK each.
HEADERS, MSS = 66, 1448
# Per message: one partly filled segment and its ACK (2 x 66), UCX's active-message and tag headers
# (< 64), and for a large message a rendezvous request and its answer (2 x (66 + 64)): < 512 bytes.
PER_MESSAGE = 512
# Per R-worker, once: the start-up exchange (hello and info as JSON, UCX's wire-up of the
# connection, the node-layout collectives, MPI_Finalize's handshake): < 64 KiB.
PER_WORKER = 64 << 10

cluster = emulated_cluster("te", 3)


def run_script(argv_prefix: list[str], out) -> dict:
    proc = subprocess.run(argv_prefix + [sys.executable, SCRIPT, str(out), str(N_PROMPTS), str(MAX_TOKENS)],
                          check=False, capture_output=True, text=True, timeout=240, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def emulated_run(cluster, tmp_path_factory):
    before = cluster.counters()
    got = run_script(cluster.launcher(3), tmp_path_factory.mktemp("emulated") / "out.json")
    return got, before, cluster.counters()


@needs_emulated_nodes
def test_tokens_over_emulated_nodes_equal_shared_memory(emulated_run, tmp_path):
    shm = run_script([MPIEXEC, "-n", "3"], tmp_path / "shm.json")
    got = emulated_run[0]
    assert got["workers"] == shm["workers"] == 2
    assert all(len(ids) == MAX_TOKENS for ids in got["outputs"])
    assert got["outputs"] == shm["outputs"]


@needs_emulated_nodes
def test_the_payload_crosses_the_fabric_within_protocol_overhead(emulated_run):
    got, before, after = emulated_run
    node0 = delta(before, after, 0, "fabric")        # rank 0's link carries every R-worker's traffic
    sent, received = got["sent"], got["received"]
    allowance = got["messages"] * PER_MESSAGE + got["workers"] * PER_WORKER
    assert sent <= node0["tx"] <= sent + (sent + received) * HEADERS / MSS + allowance, (node0, got)
    assert received <= node0["rx"] <= received + (sent + received) * HEADERS / MSS + allowance, (node0, got)
    workers = [delta(before, after, i, "fabric") for i in (1, 2)]
    assert all(w["rx"] > 0 and w["tx"] > 0 for w in workers), workers     # each R-worker on its own link
    assert sum(w["rx"] for w in workers) >= sent and sum(w["tx"] for w in workers) >= received


@needs_emulated_nodes
def test_the_management_network_carries_no_payload(emulated_run):
    """It carries the launcher's start-up exchange, forwarded output and the supervisor links:
    nothing that grows with the data, so far below the payload (here ~11 MB)."""
    got, before, after = emulated_run
    payload = got["sent"] + got["received"]
    mgmt = [delta(before, after, i, "mgmt") for i in range(3)]
    assert all(m["tx"] > 0 for m in mgmt), mgmt       # the launcher's control traffic did go there
    assert sum(m["rx"] + m["tx"] for m in mgmt) < payload / 50, (mgmt, payload)


@needs_emulated_nodes
def test_clusters_coexist_and_a_dead_owners_cluster_is_removed(cluster):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [cluster.name[:-1] + c for c in "xyz" if cluster.name[:-1] + c != cluster.name][:2]   # not the fixture's
    try:
        cli("up", "--name", names[0], "--nodes", "1", "--owner", str(os.getpid()))
        with pytest.raises(AssertionError, match="exists"):
            cli("up", "--name", names[0], "--nodes", "1")
        from fastdecode.launch import netns
        rec = netns.record(names[0])
        rec["owner"] = {"pid": dead.pid, "started": 0.0}              # as if its owner had ended
        netns._save(rec)
        cli("up", "--name", names[1], "--nodes", "1", "--owner", str(os.getpid()))
        with pytest.raises(ValueError, match="no emulated cluster"):
            netns.record(names[0])
        assert not os.path.exists(f"/var/run/netns/{netns.node_name(names[0], 0)}")
        slots = {netns.record(n)["slot"] for n in (cluster.name, names[1])}
        assert len(slots) == 2                                          # subnets of their own
    finally:
        for name in names:
            cli("down", "--name", name, check=False)


@pytest.mark.parametrize("argv,needle", [
    (["up", "--name", "Bad_Name", "--nodes", "2"], "1-8 characters"),
    (["up", "--name", "ok", "--nodes", "2", "--rate", "fast"], "rate 'fast'"),
    (["up", "--name", "ok", "--nodes", "2", "--jitter", "5us"], "--jitter needs a rate"),
    (["counters", "--name", "nosuch"], "no emulated cluster named 'nosuch'"),
])
def test_bad_arguments_are_usage_errors_naming_the_input(argv, needle):
    proc = subprocess.run(CLI + argv, check=False, capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_profiles_become_qdiscs_netem_where_the_kernel_has_it_else_a_rate_alone():
    ten = links.link_from("10gbe")
    assert (ten.rate_bit, ten.delay_us, ten.jitter_us) == (10 * 10**9, 25.0, 2.0)
    assert links.qdisc_args(ten, netem=True) == ["netem", "limit", "100000", "delay", "25.0us", "2.0us",
                                                 "rate", "10000000000bit"]
    tbf = links.qdisc_args(ten, netem=False)
    assert tbf[:3] == ["tbf", "rate", "10000000000bit"] and int(tbf[4]) >= 10**10 // 8 // 1000
    assert links.applied(ten, netem=False)["not_applied"].startswith("delay and jitter")
    assert links.qdisc_args(links.link_from("none"), netem=True) is None
    custom = links.link_from("1gbe", rate="100mbit", delay="1ms")
    assert (custom.rate_bit, custom.delay_us, custom.jitter_us) == (10**8, 1000.0, 5.0)
