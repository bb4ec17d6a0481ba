#!/usr/bin/env python
"""Stand-in for `fastdecode generate` in the SLURM tests, with the same CLI and exit codes.

    fake_fastdecode.py generate -m MODEL -i IN.jsonl -o OUT.jsonl [--r-threads N] [...]

Every rank prints one line about itself (rank, host, CPU affinity, threads, restart count).
Rank 0 copies each input line's custom_id to the output, one line every FAKE_DELAY seconds
(default 0.2; FAKE_DELAY_RERUN on reruns), flushed at once; lines already in the output are
skipped (resume).
SIGUSR1/SIGTERM on rank 0: finish the current line, then every rank exits 75.
Exit codes: 0 done, 2 bad usage (checked before any work), 75 interrupted, work saved.
Waiting ranks sleep between polls instead of blocking in MPI (more ranks than cores here).
"""
import argparse
import ctypes
import json
import os
import platform
import signal
import socket
import sys
import time

EX_USAGE, EX_TEMPFAIL = 2, 75


def parse(argv):
    p = argparse.ArgumentParser(prog="fake_fastdecode")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("-m", "--model", required=True)
    g.add_argument("-i", "--input", required=True)
    g.add_argument("-o", "--output", required=True)
    g.add_argument("--r-threads", type=int, default=0)
    args, _unknown = p.parse_known_args(argv)   # the real CLI's other options are ignored
    return args


def mempolicy() -> str:
    """This process's NUMA memory policy (get_mempolicy(2)): 'bind:<nodes>' under numactl."""
    nr = {"x86_64": 239, "aarch64": 236}.get(platform.machine())
    if nr is None:
        return "?"
    mode, mask = ctypes.c_int(), ctypes.c_ulong()
    if ctypes.CDLL(None, use_errno=True).syscall(nr, ctypes.byref(mode), ctypes.byref(mask),
                                                 64, None, 0) != 0:
        return "?"
    name = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local"}
    nodes = [i for i in range(64) if mask.value >> i & 1]
    return f"{name.get(mode.value, mode.value)}:{','.join(map(str, nodes))}"


def usage_error(args) -> str | None:
    if not os.path.isfile(args.input):
        return f"input file not found: {args.input}"
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        return f"output directory does not exist: {args.output}"
    return None


def read_ids(path):
    with open(path) as f:
        return [json.loads(line)["custom_id"] for line in f if line.strip()]


def serve(args, restart: str, stop: dict) -> int:
    """Rank 0: append one output line per input line not yet done."""
    done = set(read_ids(args.output)) if os.path.exists(args.output) else set()
    delay = float(os.environ.get("FAKE_DELAY", "0.2"))
    if int(restart) > 0:                       # lets a test make reruns quick
        delay = float(os.environ.get("FAKE_DELAY_RERUN", delay))
    todo = [cid for cid in read_ids(args.input) if cid not in done]
    print(f"fake: {len(done)} done already, {len(todo)} to do", flush=True)
    with open(args.output, "a") as out:
        for cid in todo:
            if stop["sig"]:
                print(f"fake: got {stop['sig']}, saved, exiting {EX_TEMPFAIL}", flush=True)
                return EX_TEMPFAIL
            time.sleep(delay)                  # "one request's worth of decoding"
            out.write(json.dumps({"custom_id": cid, "restart": int(restart)}) + "\n")
            out.flush()
    return 0


def main(argv) -> int:
    args = parse(argv)
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signal.Signals(signum).name

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    print(f"rank {rank} of {size} on {socket.gethostname()} "
          f"node={os.environ.get('SLURMD_NODENAME', '?')} "
          f"cpus={sorted(os.sched_getaffinity(0))} mem={mempolicy()} r_threads={args.r_threads} "
          f"omp={os.environ.get('OMP_NUM_THREADS', '-')} restart={restart}", flush=True)

    if rank == 0:
        err = usage_error(args)
        code = EX_USAGE if err else serve(args, restart, stop)
        if err:
            print(f"fake_fastdecode: error: {err}", file=sys.stderr, flush=True)
        for r in range(1, size):
            comm.send(code, dest=r, tag=7)
    else:
        req = comm.irecv(source=0, tag=7)
        while True:
            ok, code = req.test()
            if ok:
                break
            time.sleep(0.05)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
