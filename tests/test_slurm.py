"""The SLURM job scripts on a real SLURM (Debian's slurm-wlm 22.05): a two-node test cluster on
this machine (tests/slurm/cluster.py) runs scripts/slurm/*.sbatch.

The one-node srun job and the signal/requeue/resume job run the real `fastdecode generate` on
the embedded model (a few greedy requests; the resumed output must equal an uninterrupted local
run). The other tests check launchers, rank placement and binding, which a stand-in program
reports about itself (tests/slurm/fake_fastdecode.py; FASTDECODE_TEST_CMD replaces it).

Needs root and apt-get (scripts/slurm/install_test_cluster.sh installs slurm and munge);
skipped with the reason otherwise.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "slurm"))
import cluster as slurm_cluster  # noqa: E402

SINGLE = REPO / "scripts" / "slurm" / "fastdecode-single.sbatch"
HETJOB = REPO / "scripts" / "slurm" / "fastdecode-hetjob.sbatch"
FAKE = REPO / "tests" / "slurm" / "fake_fastdecode.py"
PROGRAM = os.environ.get("FASTDECODE_TEST_CMD", f"{sys.executable} {FAKE}")
REAL = f"{sys.executable} -m fastdecode"          # this checkout's CLI (PYTHONPATH below)
# greedy, fixed length, float32: the same rows whatever the batch, rank count or interruptions (the
# CPU default, bf16, keeps that only where docs/usage.md says)
REAL_BODY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
REAL_DTYPE = ["--dtype", "float32"]
REAL_ARGS = "--max-batch 2 " + " ".join(REAL_DTYPE)   # small steps: a run lasts seconds, signals land mid-run
# (not --quiet: the tests read rank 0's R-worker roster)
HET_OPTS = ("--cpus-per-task=1", ":", "--nodes=1")   # fit the test nodes (4 CPUs each)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SLURM: Linux only")


@pytest.fixture(scope="module")
def cluster():
    why = slurm_cluster.ensure_installed()
    if why:
        pytest.skip(why)
    c = slurm_cluster.SlurmCluster(nodes=2)
    c.start()
    yield c
    c.stop()


class Job:
    """One submission of a script: its files under tmp_path, a unique job name."""

    def __init__(self, cluster, tmp_path, script, n_lines=12, program=PROGRAM, delay=0.05,
                 real=False, **settings):
        self.cluster, self.script = cluster, script
        self.name = f"fd-{uuid.uuid4().hex[:8]}"
        self.input, self.output, self.log = (tmp_path / f for f in
                                             ("in.jsonl", "out.jsonl", "job.log"))
        self.ids = [f"req-{i:03d}" for i in range(n_lines)]
        write_input(self.input, self.ids, real)
        self.env = {**cluster.env, "FASTDECODE_CMD": REAL if real else program,
                    "FAKE_DELAY": str(delay), "FD_MODEL": "smollm2-135m",
                    "FD_INPUT": str(self.input), "FD_OUTPUT": str(self.output),
                    "FD_SRUN_MPI": "pmi2"}
        if real:    # one kernel thread per R-worker: 3 ranks share the 2 cores here
            self.env["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
            settings = {"extra_args": REAL_ARGS, "r_threads": 1, **settings}
        self.env.update({f"FD_{k.upper()}": str(v) for k, v in settings.items()})

    def sbatch_cmd(self, *opts, wait=True) -> list[str]:
        return ["sbatch", *(["--wait"] if wait else []), "--parsable", "-J", self.name,
                "-o", str(self.log), *opts, str(self.script)]

    def run(self, *opts) -> int:
        """`sbatch --wait`: returns its exit code, which is the job's."""
        return subprocess.run(self.sbatch_cmd(*opts), env=self.env, timeout=120,
                              stdout=subprocess.DEVNULL).returncode

    def rows(self) -> list[dict]:
        """The output's whole lines (a line being written may be cut short when read)."""
        if not self.output.exists():
            return []
        data = self.output.read_bytes()
        return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()]

    def output_ids(self) -> list[str]:
        return [r["custom_id"] for r in self.rows()]

    def report(self) -> dict:
        return json.loads(Path(f"{self.output}.summary.json").read_text())

    def ranks(self) -> dict[int, dict]:
        """The stand-in's `rank R of N on HOST node=.. cpus=[..] mem=.. ...` lines, by rank.
        (hydra may glue two ranks' lines together, so no line anchors.)"""
        pat = (r"rank (\d+) of (\d+) on \S+ node=(\S+) cpus=\[[^\]]*\] mem=(\S*) "
               r"r_threads=(\d+) omp=(\S+?) restart=(\d+)")
        keys = ("size", "node", "mem", "r_threads", "omp", "restart")
        return {int(m[0]): dict(zip(keys, m[1:])) for m in re.findall(pat, self.text())}

    def text(self) -> str:
        return self.log.read_text()

    def records(self) -> list[dict]:
        return self.cluster.job_records(self.name)

    def state(self) -> str:
        """What a failed wait reports: the job's log tail, its SLURM state and the daemons' logs."""
        log = self.text()[-4000:] if self.log.exists() else "(no job log)"
        return (f"== job log (tail)\n{log}\n== live: {self.live()}\n== records: "
                f"{self.records()}\n== output lines: {len(self.output_ids())}\n"
                f"{self.cluster.logs()}")

    def live(self) -> list[dict]:
        """`scontrol show job` of a job still known to slurmctld: one dict per component."""
        out = self.cluster.run("squeue", "-h", "-n", self.name, "-o", "%A").stdout.split()
        if not out:
            return []
        lines = self.cluster.run("scontrol", "show", "job", "-o", out[0], check=False).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines.splitlines() if line]

    def check_done(self, components=1, requeues=0):
        """Ended COMPLETED with exit 0 after `requeues` requeues; every custom_id once."""
        recs = self.records()
        assert len(recs) == components * (requeues + 1), recs
        final, earlier = recs[-components:], recs[:-components]
        assert all(r["JobState"] == "COMPLETED" and r["ExitCode"] == "0:0" for r in final), final
        # each earlier run ended in a requeue, after the job step (the program) exited 75
        assert all(r["JobState"] == "PENDING" for r in earlier), earlier
        assert self.text().count("job step exited with 75") == requeues
        got = self.output_ids()
        assert sorted(got) == sorted(self.ids) and len(got) == len(set(got)), "each id once"


def write_input(path: Path, ids: list[str], real: bool) -> None:
    body = REAL_BODY if real else {"max_tokens": 4}
    path.write_text("".join(
        json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": f"Request {cid}:", **body}}) + "\n" for cid in ids))


def stable(row: dict) -> str:
    """A row less its random ids and timestamp: equal across runs for greedy requests."""
    row = json.loads(json.dumps(row))
    row.pop("id", None)
    resp = row.get("response") or {}
    resp.pop("request_id", None)
    for key in ("id", "created"):
        (resp.get("body") or {}).pop(key, None)
    return json.dumps(row, sort_keys=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """rows(n): the output of an uninterrupted local-mode run over the first n request ids."""
    from conftest import run_fastdecode
    tmp, done = tmp_path_factory.mktemp("slurm-reference"), {}

    def rows(n: int) -> list[str]:
        if n not in done:
            inp, out = tmp / f"in-{n}.jsonl", tmp / f"out-{n}.jsonl"
            write_input(inp, [f"req-{i:03d}" for i in range(n)], real=True)
            proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", *REAL_DTYPE], timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[n] = [stable(json.loads(line)) for line in out.read_text().splitlines()]
        return done[n]
    return rows


def wait_for(predicate, timeout, what, detail=None):
    """Poll predicate until true; on timeout fail naming `what`, with detail() if given."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f"\n{detail()}" if detail else ""))


# ---- the cluster itself ---------------------------------------------------------------------
def test_cluster_has_two_idle_nodes_and_a_gpu(cluster):
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t %G").stdout.split("\n")
    assert "n1 idle gpu:1" in out and "n2 idle (null)" in out
    assert "22.05" in cluster.run("sinfo", "--version").stdout


# ---- single allocation --------------------------------------------------------------------------
def test_single_one_node_srun_pmi2_real_fastdecode(cluster, tmp_path, reference):
    job = Job(cluster, tmp_path, SINGLE, real=True)
    assert job.run("-N", "1") == 0, job.text()
    job.check_done()
    assert [stable(r) for r in job.rows()] == reference(len(job.ids)), job.text()
    log = job.text()
    for rank in (1, 2):                   # rank 0's roster: one R-worker per socket, 1 thread each
        assert re.search(rf"rank {rank} = R-worker pid \d+ on \S+: \w+, 1 threads", log), log
    assert "Throughput:" in log and "via srun --mpi=pmi2" in log and "binding: numactl" in log
    report = job.report()
    assert report["state"] == "done" and report["lines"]["ok"] == len(job.ids)
    assert [w["rank"] for w in report["rworkers"]] == [1, 2]


def test_single_one_node_srun_pmi2_binds_r_workers(cluster, tmp_path):
    job = Job(cluster, tmp_path, SINGLE)
    assert job.run("-N", "1") == 0, job.text()
    job.check_done()
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1, 2], job.text()   # S-worker + one R-worker per socket
    assert all(r["node"] == "n1" and r["size"] == "3" for r in ranks.values())
    # R-workers: numactl --membind, OMP threads = cores per socket; the S-worker: neither
    assert ranks[0]["mem"] == "default:" and ranks[0]["omp"] == "-"
    for r in (1, 2):
        assert ranks[r]["mem"] == "bind:0" and ranks[r]["omp"] == "2"
        assert ranks[r]["r_threads"] == "2"
    assert "binding: numactl" in job.text() and "via srun --mpi=pmi2" in job.text()


def test_single_two_nodes_mpiexec(cluster, tmp_path):
    job = Job(cluster, tmp_path, SINGLE, mpi_launcher="mpiexec")
    assert job.run("-N", "2", "--gpus=0") == 0, job.text()
    job.check_done()
    ranks = job.ranks()
    assert [ranks[r]["node"] for r in (0, 1, 2)] == ["n1", "n2", "n2"], job.text()
    assert [ranks[r]["mem"] for r in (0, 1, 2)] == ["default:", "bind:0", "bind:0"]
    assert "via mpiexec" in job.text()


def test_single_one_node_mpiexec_binds_by_mpi_rank(cluster, tmp_path):
    # one hydra proxy runs all three ranks: the wrapper must use PMI_RANK, not SLURM_PROCID
    job = Job(cluster, tmp_path, SINGLE, mpi_launcher="mpiexec")
    assert job.run("-N", "1") == 0, job.text()
    job.check_done()
    ranks = job.ranks()
    assert [ranks[r]["mem"] for r in (0, 1, 2)] == ["default:", "bind:0", "bind:0"], job.text()
    assert [ranks[r]["omp"] for r in (0, 1, 2)] == ["-", "2", "2"]


def _site_mpi_python():
    """Debian's python3 with Debian's mpi4py (Open MPI built with PMIx): a 'site MPI'."""
    py = shutil.which("python3", path="/usr/bin")
    if py and subprocess.run([py, "-c", "import mpi4py"], capture_output=True).returncode == 0:
        return py
    return None


@pytest.mark.skipif(_site_mpi_python() is None,
                    reason="no Debian python3-mpi4py (Open MPI + PMIx) for srun --mpi=pmix")
def test_single_two_nodes_srun_pmix_open_mpi(cluster, tmp_path):
    job = Job(cluster, tmp_path, SINGLE, program=f"{_site_mpi_python()} {FAKE}",
              srun_mpi="pmix")
    assert job.run("-N", "2", "--gpus=0") == 0, job.text()
    job.check_done()
    ranks = job.ranks()
    assert [ranks[r]["node"] for r in (0, 1, 2)] == ["n1", "n2", "n2"], job.text()
    assert "via srun --mpi=pmix" in job.text()


def test_bad_usage_exit_2_is_not_requeued(cluster, tmp_path):
    job = Job(cluster, tmp_path, SINGLE)
    job.input.unlink()                          # the program exits 2: input file not found
    assert job.run("-N", "1") == 2, job.text()
    assert "not requeueing" in job.text() and "requeueing job" not in job.text()
    time.sleep(2)                               # a requeue would have been recorded by now
    [rec] = job.records()
    assert rec["JobState"] == "FAILED" and rec["ExitCode"] == "2:0"


# ---- heterogeneous job --------------------------------------------------------------------------
def test_hetjob_one_comm_world_across_components(cluster, tmp_path):
    job = Job(cluster, tmp_path, HETJOB)
    assert job.run(*HET_OPTS) == 0, job.text()
    job.check_done(components=2)
    assert [r["NodeList"] for r in job.records()] == ["n1", "n2"]   # GPU comp, CPU comp
    ranks = job.ranks()
    assert all(r["size"] == "3" for r in ranks.values())            # one MPI_COMM_WORLD
    assert [ranks[r]["node"] for r in (0, 1, 2)] == ["n1", "n2", "n2"], job.text()
    assert ranks[0]["mem"] == "default:" and ranks[1]["mem"] == ranks[2]["mem"] == "bind:0"


# ---- preemption: signal -> exit 75 -> requeue -> resume -------------------------------------
def release(job):
    """Wait for a requeued job to run again. The test cluster makes it eligible ~11 s after the
    requeue (cred_expire=10 in its slurm.conf). Not forced sooner with `scontrol update
    StartTime=now`: slurmd refuses a run whose credentials predate the old run's revocation
    ("Job credential revoked"), the job then ends FAILED, and under load that window is longer
    than any fixed wait."""
    def running():
        comps = job.live()
        return (comps and all(c["JobState"] == "RUNNING" for c in comps)) or \
            len(job.output_ids()) == len(job.ids)
    wait_for(running, 60, "the requeued job to start again", job.state)


def ranks_up(log: str, runs: int) -> bool:
    """Every rank has announced itself `runs` times in the job log: the stand-in's "rank i of n"
    lines, or the real program's roster ("fastdecode: rank i = R-worker ...", printed once every
    R-worker has said hello)."""
    fake = re.findall(r"rank (\d+) of (\d+)", log)
    if fake:
        size = int(fake[-1][1])
        return all(sum(1 for r, _ in fake if int(r) == i) >= runs for i in range(size))
    real = re.findall(r"fastdecode: rank (\d+) = R-worker", log)
    return bool(real) and all(real.count(r) >= runs for r in set(real))


def interrupt_and_resume(job, opts, signals):
    """`sbatch --wait` the job; for each signal: let it write some lines, signal the batch
    script, see the job requeue itself and run again; `sbatch --wait` returns when it is done."""
    proc = subprocess.Popen(job.sbatch_cmd(*opts, wait=True), env=job.env,
                            stdout=subprocess.DEVNULL)
    try:
        for restart, sig in enumerate(signals):
            start = len(job.output_ids())
            wait_for(lambda: len(job.output_ids()) >= start + 3, 60, f"progress in run {restart}",
                     job.state)
            # every rank must be up (its signal handling in place) before the signal: rank 0 may
            # write lines while the other component's tasks are still starting
            wait_for(lambda: ranks_up(job.text(), restart + 1), 60, f"every rank up in run {restart}",
                     job.state)
            [jid] = {c["JobId"] for c in job.live() if c.get("HetJobOffset", "0") == "0"}
            assert all(c["Restarts"] == str(restart) for c in job.live())
            job.cluster.run("scancel", f"--signal={sig}", "--batch", jid)
            wait_for(lambda: job.live() and all(c["Restarts"] == str(restart + 1)
                                                for c in job.live()), 120,
                     f"requeue #{restart + 1}", job.state)
            release(job)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_single_signals_requeue_and_resume_three_times(cluster, tmp_path, reference):
    """The real program: each signal stops it after the step in flight (exit 75), the job
    requeues, the rerun resumes from the output; the end result is the uninterrupted output."""
    job = Job(cluster, tmp_path, SINGLE, n_lines=32, real=True)
    assert interrupt_and_resume(job, ("-N", "1"), ["USR1", "TERM", "USR1"]) == 0, job.text()
    job.check_done(requeues=3)
    assert [stable(r) for r in job.rows()] == reference(len(job.ids)), job.text()
    log = job.text()
    for n in (1, 2, 3):                          # SLURM_RESTART_COUNT as the script saw it
        assert re.search(rf"rerun #{n} of job \d+: resuming", log), log
    assert log.count("got SIGUSR1, forwarding") == 2 and log.count("got SIGTERM, forwarding") >= 1
    # the script forwards both as SIGUSR1; the program saved and said so each time
    assert len(re.findall(r"interrupted by SIG\w+: \d+ of 32 requests done", log)) == 3, log
    assert log.count("fastdecode: resuming: ") == 3
    assert log.count("interrupted with work saved: requeueing job") == 3
    history = job.report()["history"]            # every run served part, none served a line twice
    assert [h["state"] for h in history] == ["interrupted"] * 3 + ["done"], history
    assert all(h["requests"] > 0 for h in history) and sum(h["requests"] for h in history) == 32


def test_hetjob_signal_requeue_and_resume(cluster, tmp_path):
    job = Job(cluster, tmp_path, HETJOB, n_lines=24, delay=0.1)
    assert interrupt_and_resume(job, HET_OPTS, ["USR1"]) == 0, job.text()
    job.check_done(components=2, requeues=1)
    assert re.search(r"rerun #1 of job \d+: resuming", job.text())
    assert "fake: got SIGUSR1" in job.text()


def test_time_limit_warning_signal_requeues_before_the_limit(cluster, tmp_path):
    """The real preemption path: `--signal=B:USR1@S` makes slurmctld itself signal the batch
    script S seconds before the time limit (checked every ~30 s, so it comes 5..35 s into this
    1-minute job); the job saves, requeues itself and finishes instead of hitting TIMEOUT."""
    job = Job(cluster, tmp_path, SINGLE, n_lines=200, delay=0.3)   # 60 s: needs the signal
    job.env["FAKE_DELAY_RERUN"] = "0.02"
    proc = subprocess.Popen(job.sbatch_cmd("-N", "1", "--time=1", "--signal=B:USR1@55"),
                            env=job.env, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: job.live() and job.live()[0]["Restarts"] == "1", 120, "the requeue",
                 job.state)
        release(job)
        assert proc.wait(timeout=60) == 0, job.text()
    finally:
        if proc.poll() is None:
            proc.kill()
    job.check_done(requeues=1)
    assert "got SIGUSR1, forwarding" in job.text() and "fake: got SIGUSR1" in job.text()
    assert re.search(r"rerun #1 of job \d+: resuming", job.text())
