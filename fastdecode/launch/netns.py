"""Emulated nodes on one machine: each node a network namespace with its own host name, joined to
the others by real TCP links, so that MPI ranks talk as they would between machines.

Every node has two links, as a cluster has two networks:
- management (`eth0`, 10.77.S.0/24): the launcher's control connections (Hydra's `-iface`) and
  fastdecode's supervisor links; never shaped, never taken down;
- fabric (`fab0`, 10.78.S.0/24): MPI's data (UCX over TCP on `fab0`: `UCX_TLS=tcp`,
  `UCX_NET_DEVICES=fab0`), shaped by `tc` on both ends of its veth pair (the bridge-side end's
  egress is traffic to the node, the node-side end's egress traffic from it) and taken down for
  a partition.
S is the cluster's slot, unique among the clusters that exist at once. Names (<= 15 characters,
the kernel's limit): namespaces `fd-NAME-nI` (also the node's host name and the launcher's host
name), bridges `fdNAMEm` and `fdNAMEf`, bridge-side veths `fdNAMEmI` and `fdNAMEfI`.

Clusters are made and removed under a lock; each records its owner (a pid, or none for one that
lives until `down`) in /run/fastdecode-emulated/NAME.json, and clusters of dead owners are
removed whenever another is made. Ranks start through MPICH Hydra's ssh launcher, whose
`-launcher-exec` script (written beside the records) runs each host's command in its namespace.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time

from fastdecode.launch import netns_links as links

STATE_DIR = "/run/fastdecode-emulated"
MGMT_NET, FABRIC_NET = "10.77", "10.78"      # + .SLOT.0/24
MGMT_IF, FABRIC_IF = "eth0", "fab0"          # inside each node
MAX_NODES, MAX_SLOTS = 64, 250
NAME_RE = re.compile(r"[a-z0-9]{1,8}")
EXEC_SCRIPT = """#!/bin/bash
# Hydra's ssh launcher calls SCRIPT [ssh options] HOST "command": run it in HOST's namespace, with
# HOST as the host name (a UTS namespace of its own), as sshd would on that node
while [[ "$1" == -* ]]; do shift; done
host=$1; shift
exec ip netns exec "$host" unshare --uts /bin/bash -c 'hostname "$0" && exec /bin/bash -c "$1"' "$host" "$*"
"""


class Unavailable(RuntimeError):
    """This machine cannot make emulated nodes; the message says why."""


def unavailable() -> str | None:
    """Why this machine cannot make emulated nodes, or None."""
    if os.geteuid() != 0:
        return "not root: network namespaces, veth pairs and tc need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command: install iproute2 (ip, tc) and util-linux (unshare)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no network namespaces here (unshare --net: {probe.stderr.strip() or probe.returncode})"
    if hydra_mpiexec() is None:
        return "no MPICH Hydra `mpiexec` (the emulated nodes start ranks through Hydra's -launcher-exec)"
    return None


def hydra_mpiexec() -> str | None:
    """MPICH's Hydra `mpiexec`: beside this Python first (pip's MPICH), then on PATH."""
    from fastdecode.launch.info import probe_launcher
    for path in (os.path.join(os.path.dirname(sys.executable), "mpiexec"), shutil.which("mpiexec")):
        if path and os.access(path, os.X_OK) and probe_launcher(path).startswith("MPICH Hydra"):
            return path
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def node_name(name: str, i: int) -> str:
    return f"fd-{name}-n{i}"


def veth(name: str, net: str, i: int) -> str:
    """The bridge-side end of node i's veth pair on net 'm' (management) or 'f' (fabric)."""
    return f"fd{name}{net}{i}"


@contextlib.contextmanager
def _locked():
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _record_path(name: str) -> str:
    return os.path.join(STATE_DIR, f"{name}.json")


def record(name: str) -> dict:
    try:
        with open(_record_path(name)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no emulated cluster named {name!r} (make it with `up --name {name}`)") from None


def _save(rec: dict) -> None:
    tmp = _record_path(rec["name"]) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(tmp, _record_path(rec["name"]))


def _records() -> list[dict]:
    out = []
    for entry in sorted(os.listdir(STATE_DIR)) if os.path.isdir(STATE_DIR) else []:
        if entry.endswith(".json"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(STATE_DIR, entry)) as f:
                out.append(json.load(f))
    return out


def _owner_alive(owner: dict | None) -> bool:
    if owner is None:
        return True                     # lives until `down`
    import psutil
    try:
        return abs(psutil.Process(owner["pid"]).create_time() - owner["started"]) < 1.0
    except psutil.Error:
        return False


def _owner(pid: int | None) -> dict | None:
    if pid is None:
        return None
    import psutil
    return {"pid": pid, "started": psutil.Process(pid).create_time()}


def up(name: str, nodes: int, link: links.Link | None = None, owner_pid: int | None = None) -> dict:
    """Make cluster `name` of `nodes` nodes, every fabric link shaped as `link`; its record."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"cluster name {name!r}: 1-8 characters of a-z and 0-9 (interface names are short)")
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"--nodes {nodes}: 1..{MAX_NODES}")
    why = unavailable()
    if why:
        raise Unavailable(why)
    with _locked():
        for rec in _records():
            if not _owner_alive(rec.get("owner")):
                _teardown(rec)
        if os.path.exists(_record_path(name)):
            raise ValueError(f"an emulated cluster named {name!r} exists: `down --name {name}` first")
        used = {r["slot"] for r in _records()}
        slot = next((s for s in range(MAX_SLOTS) if s not in used and not _subnet_in_use(s)), None)
        if slot is None:
            raise RuntimeError(f"no free subnet among {MGMT_NET}.0-{MAX_SLOTS - 1}.0/24")
        script = os.path.join(STATE_DIR, "launcher-exec.sh")
        with open(script, "w") as f:
            f.write(EXEC_SCRIPT)
        os.chmod(script, 0o755)
        rec = {"name": name, "nodes": nodes, "slot": slot, "owner": _owner(owner_pid), "netem": links.has_netem(),
               "launcher_exec": script, "shape": {}}
        _save(rec)                      # first: a failure below leaves a record that `down` removes
        try:
            _build(rec)
        except BaseException:
            _teardown(rec)
            raise
    for i in range(nodes):
        shape(name, i, link or links.PROFILES["none"])
    return record(name)


def _subnet_in_use(slot: int) -> bool:
    routes = _run("ip", "-4", "route", "show", check=False).stdout
    return any(f"{net}.{slot}." in routes for net in (MGMT_NET, FABRIC_NET))


def _build(rec: dict) -> None:
    name, slot = rec["name"], rec["slot"]
    for net, prefix in (("m", MGMT_NET), ("f", FABRIC_NET)):
        bridge = f"fd{name}{net}"
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{prefix}.{slot}.254/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
    for i in range(rec["nodes"]):
        ns = node_name(name, i)
        _run("ip", "netns", "add", ns)
        _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1", check=False)   # no IPv6 chatter in the counters
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        for net, prefix, inside in (("m", MGMT_NET, MGMT_IF), ("f", FABRIC_NET, FABRIC_IF)):
            outside = veth(name, net, i)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
            _run("ip", "link", "set", outside, "master", f"fd{name}{net}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{prefix}.{slot}.{i + 1}/24", "dev", inside)
            _run("ip", "-n", ns, "link", "set", inside, "up")


def _teardown(rec: dict) -> None:
    name = rec["name"]
    for i in range(rec["nodes"]):
        _run("ip", "netns", "del", node_name(name, i), check=False)      # takes the veth pairs with it
        for net in "mf":
            _run("ip", "link", "del", veth(name, net, i), check=False)
    for net in "mf":
        _run("ip", "link", "del", f"fd{name}{net}", check=False)
    with contextlib.suppress(FileNotFoundError):
        os.remove(_record_path(name))


def down(name: str) -> None:
    """Remove cluster `name` (its namespaces, links and record)."""
    with _locked():
        _teardown(record(name))


def _node(rec: dict, i: int) -> int:
    if not 0 <= i < rec["nodes"]:
        raise ValueError(f"--node {i}: cluster {rec['name']!r} has nodes 0..{rec['nodes'] - 1}")
    return i


def shape(name: str, i: int, link: links.Link) -> dict:
    """Shape node i's fabric link, both directions, as `link`; what was applied."""
    rec = record(name)
    _node(rec, i)
    args = links.qdisc_args(link, rec["netem"])
    for where in (["tc"], ["tc", "-n", node_name(name, i)]):
        dev = veth(name, "f", i) if len(where) == 1 else FABRIC_IF
        if args is None:
            _run(*where, "qdisc", "del", "dev", dev, "root", check=False)
        else:
            _run(*where, "qdisc", "replace", "dev", dev, "root", *args)
    with _locked():
        rec = record(name)
        rec["shape"][str(i)] = links.applied(link, rec["netem"])
        _save(rec)
    return rec["shape"][str(i)]


def set_link(name: str, i: int, is_up: bool) -> None:
    """Node i's fabric link up or down (a partition: its TCP connections stall, nothing is reset)."""
    _node(record(name), i)
    _run("ip", "link", "set", veth(name, "f", i), "up" if is_up else "down")


def counters(name: str) -> dict:
    """Bytes each node sent and received on each network (read at the bridge-side veth, whose rx is
    the node's tx), with the shaping applied: {"nodes": [{"node", "fabric": {"rx", "tx"}, "mgmt": ...}]}."""
    rec = record(name)
    nodes = []
    for i in range(rec["nodes"]):
        entry = {"node": i, "host": node_name(name, i)}
        for net, key in (("f", "fabric"), ("m", "mgmt")):
            base = f"/sys/class/net/{veth(name, net, i)}/statistics"
            with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:
                entry[key] = {"tx": int(rx.read()), "rx": int(tx.read())}
        with open(f"/sys/class/net/{veth(name, 'f', i)}/operstate") as f:
            entry["fabric_link"] = f.read().strip()
        entry["shape"] = rec["shape"].get(str(i))
        nodes.append(entry)
    return {"name": name, "nodes": nodes}


def mpiexec_env(name: str) -> dict[str, str]:
    """What the ranks need to send their data over the fabric: UCX's TCP transport on fab0 (by
    itself UCX finds the other ranks on the same machine and uses shared memory)."""
    return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": FABRIC_IF, "MPIR_CVAR_CH4_NETMOD": "ucx"}


def mpiexec_argv(name: str, ranks: int, command: list[str]) -> list[str]:
    """argv that runs `command` as `ranks` MPI ranks, rank i on node i, from node 0's namespace."""
    rec = record(name)
    if not 1 <= ranks <= rec["nodes"]:
        raise ValueError(f"-n {ranks}: cluster {name!r} has {rec['nodes']} nodes (one rank per node)")
    mpiexec = hydra_mpiexec()
    if mpiexec is None:
        raise Unavailable(unavailable() or "no MPICH Hydra mpiexec")
    hosts = ",".join(node_name(name, i) for i in range(ranks))
    inner = [mpiexec, "-genvall", "-launcher", "ssh", "-launcher-exec", rec["launcher_exec"], "-hosts", hosts,
             "-ppn", "1", "-n", str(ranks), "-iface", MGMT_IF] + list(command)
    return ["ip", "netns", "exec", node_name(name, 0), "unshare", "--uts", "/bin/bash", "-c",
            'hostname "$0" && exec "$@"', node_name(name, 0)] + inner


@contextlib.contextmanager
def cluster(name: str, nodes: int, link: links.Link | None = None):
    """An emulated cluster for the life of the block (and of this process: a crash leaves a record
    that the next `up` removes)."""
    up(name, nodes, link, owner_pid=os.getpid())
    try:
        yield record(name)
    finally:
        with contextlib.suppress(ValueError):
            down(name)


def wait_for(predicate, limit_s: float, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
