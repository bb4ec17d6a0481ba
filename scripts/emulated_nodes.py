#!/usr/bin/env python3
"""Emulated nodes on this machine: network namespaces joined by real TCP links (docs/emulated_nodes.md).

  emulated_nodes.py up --name N --nodes K [--profile P | --rate R --delay D --jitter J] [--owner PID]
  emulated_nodes.py down --name N
  emulated_nodes.py shape --name N --node I (--profile P | --rate R --delay D --jitter J)
  emulated_nodes.py link --name N --node I up|down
  emulated_nodes.py counters --name N
  emulated_nodes.py mpiexec --name N -n K CMD...      (rank i on node i; as a --launcher prefix)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fastdecode.launch import netns, netns_links


def add_link_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", choices=list(netns_links.PROFILES), help="link profile (default: none)")
    p.add_argument("--rate", help="fabric rate, each direction (10gbit, 100mbit); overrides the profile's")
    p.add_argument("--delay", help="one-way delay, each direction (25us, 1ms); overrides the profile's")
    p.add_argument("--jitter", help="delay jitter (2us); needs a rate; overrides the profile's")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="emulated_nodes.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="make a cluster")
    p.add_argument("--name", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--owner", type=int, help="remove the cluster once this process has ended (default: at `down`)")
    add_link_flags(p)
    p = sub.add_parser("down", help="remove a cluster")
    p.add_argument("--name", required=True)
    p = sub.add_parser("shape", help="shape one node's fabric link")
    p.add_argument("--name", required=True)
    p.add_argument("--node", type=int, required=True)
    add_link_flags(p)
    p = sub.add_parser("link", help="take one node's fabric link down or up")
    p.add_argument("--name", required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("state", choices=["up", "down"])
    p = sub.add_parser("counters", help="bytes per node on each network, as JSON")
    p.add_argument("--name", required=True)
    p = sub.add_parser("mpiexec", help="run CMD as K ranks over the cluster's first K nodes")
    p.add_argument("--name", required=True)
    p.add_argument("-n", type=int, required=True, dest="ranks")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd in ("up", "shape"):
            link = netns_links.link_from(args.profile, args.rate, args.delay, args.jitter)
        if args.cmd == "up":
            rec = netns.up(args.name, args.nodes, link, owner_pid=args.owner)
            print(json.dumps(rec, indent=1))
        elif args.cmd == "down":
            netns.down(args.name)
        elif args.cmd == "shape":
            print(json.dumps(netns.shape(args.name, args.node, link)))
        elif args.cmd == "link":
            netns.set_link(args.name, args.node, args.state == "up")
        elif args.cmd == "counters":
            print(json.dumps(netns.counters(args.name), indent=1))
        elif args.cmd == "mpiexec":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise ValueError("mpiexec: no command to run")
            argv = netns.mpiexec_argv(args.name, args.ranks, command)
            os.environ.update(netns.mpiexec_env(args.name))
            sys.stdout.flush()
            os.execvp(argv[0], argv)        # the launcher's pid is this one: signals reach mpiexec
    except (ValueError, netns.Unavailable, RuntimeError) as e:
        print(f"emulated_nodes.py {args.cmd}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
