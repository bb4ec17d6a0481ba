"""A real SLURM cluster on this one machine, for tests: munged + slurmctld + N slurmd.

Everything lives under one state directory (default: $TMPDIR/fastdecode-slurm): munge key and
socket, slurm.conf, spool and state dirs, logs, pid files. /etc is never touched; clients find
the cluster through SLURM_CONF (see `SlurmCluster.env`).

The N "nodes" are N slurmd daemons on this host (`slurmd -N nK`, one port each). Two nodes let
a two-component heterogeneous job run: the backfill scheduler, the only one that starts
hetjobs, needs a node per component, so on one node a hetjob stays pending ("Resources").
Each node advertises more CPUs and sockets than the machine has (SlurmdParameters=
config_overrides) so that jobs with 1 S-worker + 2 R-workers fit on a 2-core machine.

    python tests/slurm/cluster.py start   # prints `export SLURM_CONF=...`
    python tests/slurm/cluster.py stop
"""
from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "scripts" / "slurm" / "install_test_cluster.sh"
DEFAULT_ROOT = Path(os.environ.get("FASTDECODE_SLURM_DIR",
                                   Path(tempfile.gettempdir()) / "fastdecode-slurm"))
DAEMONS = ("slurmd-n*.pid", "slurmctld.pid", "munged.pid")

SLURM_CONF = """\
ClusterName=fdtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job is eligible again cred_expire+1 s after its requeue (120 s by
# default); 10 s lets the preemption tests' reruns start on their own, soon.
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/ctld-state
SlurmdSpoolDir={root}/spool-%n
# Per-node TmpFS: the PMIx plugin puts its client dir under TmpFS (node name expanded); two
# slurmd on one host would otherwise collide on /tmp/spmix_appdir_<uid>_<job>.<step>.
TmpFS={root}/tmp-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups, no binding by slurm: works in containers and VMs without cgroup delegation.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Every end of a job (each requeue too) as one line of key=value pairs: the tests' record of
# final states, since there is no slurmdbd for sacct and job records leave slurmctld quickly.
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Fast turnaround for tests: backfill (which starts hetjobs) every second, no batch delay.
SchedulerParameters=bf_interval=1,batch_sched_delay=0
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
# Keep finished jobs only 4 s: `sbatch --wait` then polls every 2 s instead of 2, 8, 32 s.
MinJobAge=4
JobRequeue=1
# Job ids start anew with every fresh state dir. MPICH names its shared-memory segments after
# the PMI job (/dev/shm/mpich_shm_<hash of job id>_<node>), and a rank killed earlier leaves its
# segment behind: a later job with the same id then fails MPI_Init ("Out of memory" in
# MPIDI_POSIX_comm_bootstrap). A random first id keeps each cluster's ids apart.
FirstJobId={first_job_id}
GresTypes=gpu
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = ("NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
             "CPUs={cpus} Sockets={sockets} CoresPerSocket={cores} ThreadsPerCore=1 "
             "RealMemory=2048 State=UNKNOWN{gres}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_installed() -> bool:
    return all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "munged"))


def ensure_installed() -> str | None:
    """Run the install script where we can (root + apt-get; it is a no-op when all is there).
    Returns None when a test cluster can run here, else why not."""
    if os.geteuid() != 0:
        return "the test cluster runs slurmd and its jobs as root; we are not root"
    if shutil.which("apt-get"):
        r = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True)
        if r.returncode != 0 and not slurm_installed():
            return f"installing slurm-wlm failed: {r.stderr.strip()[-500:]}"
    if not slurm_installed():
        return "slurm-wlm is not installed and there is no apt-get to install it"
    return None


class SlurmCluster:
    def __init__(self, root: Path | str = DEFAULT_ROOT, nodes: int = 2, sockets: int = 2,
                 cores_per_socket: int = 2):
        self.root = Path(root)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.sockets, self.cores = sockets, cores_per_socket
        self.conf = self.root / "slurm.conf"

    @property
    def env(self) -> dict:
        """Environment for client commands (sbatch, squeue, scontrol, ...)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **kw):
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout, **kw)

    # ---- start ------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> "SlurmCluster":
        self.stop()                        # idempotent: clear whatever a previous run left
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float):
        per_node = [f"{kind}-{n}" for n in self.nodes for kind in ("spool", "tmp")]
        for d in ("munge", "ctld-state", "log", *per_node):
            (self.root / d).mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)         # munged refuses keys/sockets in loose dirs
        self._start_munge()
        self._write_conf()
        self._daemon(["slurmctld", "-f", str(self.conf)], "slurmctld")
        for n in self.nodes:
            self._daemon(["slurmd", "-f", str(self.conf), "-N", n], f"slurmd-{n}")
        self.wait_idle(timeout)

    def _start_munge(self):
        m = self.root / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={m}/munge.socket",
                        f"--pid-file={self.root}/munged.pid", f"--log-file={m}/munged.log",
                        f"--seed-file={m}/munged.seed"], check=True, capture_output=True)

    def _write_conf(self):
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            NODE_LINE.format(name=n, host=host, port=_free_port(), sockets=self.sockets,
                             cores=self.cores, cpus=self.sockets * self.cores,
                             gres=" Gres=gpu:1" if n == self.nodes[0] else "")
            for n in self.nodes)
        # A pretend GPU on the first node so that `--gpus=1` can be scheduled. slurmd drops a
        # GPU without a device file; any file will do since no cgroup guards devices here.
        fake_dev = self.root / "fake-gpu0"
        fake_dev.touch()
        (self.root / "gres.conf").write_text(
            f"NodeName={self.nodes[0]} Name=gpu File={fake_dev}\n")
        self.conf.write_text(SLURM_CONF.format(host=host, ctld_port=_free_port(),
                                               first_job_id=random.randrange(1000, 60_000_000, 1000),
                                               root=self.root, nodes=nodes))

    def _daemon(self, cmd: list[str], name: str):
        # The daemons fork into the background and write their pid file themselves.
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{name} failed to start: {r.stderr}\n{self.logs()}")

    def wait_idle(self, timeout: float = 60):
        """Wait until every node is idle in sinfo."""
        deadline = time.time() + timeout
        out = ""
        while time.time() < deadline:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            out = r.stdout.strip()
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.5)
        raise TimeoutError(f"nodes not idle after {timeout}s: {out!r}\n{self.logs()}")

    # ---- stop -------------------------------------------------------------------------
    def stop(self):
        """Cancel all jobs, kill the daemons this state dir records, remove the state dir."""
        if self.root.exists():
            self._cancel_all_jobs()
            _kill_pid_files([f for pattern in DAEMONS for f in self.root.glob(pattern)])
            if os.environ.get("FASTDECODE_SLURM_KEEP"):        # logs for a post-mortem
                keep = self.root.with_name(self.root.name + ".last")
                shutil.rmtree(keep, ignore_errors=True)
                self.root.rename(keep)
            shutil.rmtree(self.root, ignore_errors=True)

    def _cancel_all_jobs(self, wait: float = 15):
        # Job processes (slurmstepd and the tasks) outlive slurmd: end them through slurm.
        if not (self.conf.exists() and (self.root / "slurmctld.pid").exists()):
            return
        try:
            if self.run("scancel", "--full", "--quiet",
                        f"--user={pwd.getpwuid(os.getuid()).pw_name}", check=False,
                        timeout=10).returncode != 0:
                return
            deadline = time.time() + wait
            while time.time() < deadline:
                r = self.run("squeue", "-h", "-t", "all", "-o", "%i %T", check=False, timeout=10)
                if r.returncode != 0 or not any(
                        w in r.stdout for w in ("RUNNING", "COMPLETING", "CONFIGURING")):
                    return
                time.sleep(0.3)
        except subprocess.TimeoutExpired:
            pass

    def job_records(self, name: str) -> list[dict]:
        """jobcomp records of jobs called `name`, oldest first: one per end of each component
        (a requeue ends a run with JobState=PENDING; DerivedExitCode = the steps' highest)."""
        path = self.root / "jobcomp.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        records = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines]
        return [r for r in records if r.get("Name") == name]

    def logs(self, tail: int = 30) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"== {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _kill_pid_files(pid_files: list[Path], wait: float = 10):
    """SIGTERM the daemons named in pid_files (those pids that still are those daemons), wait
    for them together, SIGKILL what is left."""
    pids = []
    for pid_file in pid_files:
        try:
            pid = int(pid_file.read_text().split()[0])
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if pid_file.name.startswith(comm[:6]):          # else: a reused pid, leave it
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
        except (ValueError, IndexError, OSError):
            pass
    deadline = time.time() + wait
    while pids and time.time() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "start"
    cluster = SlurmCluster()
    if cmd == "start":
        why = ensure_installed()
        if why:
            print(why, file=sys.stderr)
            return 1
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    elif cmd == "stop":
        cluster.stop()
    else:
        print("usage: cluster.py start|stop", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
