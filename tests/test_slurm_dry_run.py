"""The SLURM scripts' --help and --dry-run, without SLURM: the node layout and the exact launch
command, in a pretend allocation (FD_DRY_*) or an allocation a stand-in scontrol describes, then
the job's own start-up checks (`generate --dry-run`: model, input, output), exit 2 as the job."""
from __future__ import annotations

import os
import re
import stat
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

SINGLE = os.path.join(REPO, "scripts", "slurm", "fastdecode-single.sbatch")
HETJOB = os.path.join(REPO, "scripts", "slurm", "fastdecode-hetjob.sbatch")
NO_SLURM = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_HET_SIZE", "SLURM_RESTART_COUNT", "SLURM_HOSTFILE")


def this_checkout_on_path(tmp_path, path: str) -> str:
    """A `fastdecode` command that runs this checkout's CLI, first on PATH (the scripts' default)."""
    bin_dir = tmp_path / "fdbin"
    bin_dir.mkdir(exist_ok=True)
    program = bin_dir / "fastdecode"
    program.write_text(f'#!/bin/bash\nPYTHONPATH={REPO} exec {sys.executable} -m fastdecode "$@"\n')
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return f"{bin_dir}{os.pathsep}{path}"


def run(script: str, *args: str, env: dict | None = None, tmp_path=None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in NO_SLURM and not k.startswith("FD_")}
    if not (tmp_path / "requests.jsonl").exists():        # the scripts' default input
        shutil.copy(os.path.join(REPO, "examples", "prompts.jsonl"), tmp_path / "requests.jsonl")
    env = dict(env or {})
    path = this_checkout_on_path(tmp_path, env.pop("PATH", os.environ["PATH"]))
    full.update(TMPDIR=str(tmp_path), FD_BIND="numactl", PATH=path, **env)
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=full, cwd=tmp_path, timeout=60)


@pytest.mark.parametrize("script", [SINGLE, HETJOB])
def test_help_and_a_wrong_argument(script, tmp_path):
    proc = run(script, "--help", tmp_path=tmp_path)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "FD_MODEL" in proc.stdout, proc.stderr
    assert "docs/cluster.md" in proc.stdout
    proc = run(script, "--bogus", tmp_path=tmp_path)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr


def layout(stdout: str) -> list[str]:
    return [" ".join(line.split()) for line in stdout.splitlines() if line.startswith("  rank ")]


def launch(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("launch: "))


def test_single_pretend_allocation(tmp_path):
    shutil.copy(os.path.join(REPO, "examples", "prompts.jsonl"), tmp_path / "in put.jsonl")
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path,
               env=dict(FD_DRY_NODES="gpu1 cpu1 cpu2", FD_DRY_SOCKETS="2", FD_DRY_CORES="8", FD_MODEL="smollm2-135m",
                        FD_INPUT="in put.jsonl", FD_EXTRA_ARGS="--max-batch 4096"))
    assert proc.returncode == 0, proc.stderr
    assert layout(proc.stdout) == [
        "rank 0 gpu1 S-worker (the GPU)",
        "rank 1 cpu1 R-worker, 8 threads, bound to socket/NUMA node 0",
        "rank 2 cpu1 R-worker, 8 threads, bound to socket/NUMA node 1",
        "rank 3 cpu2 R-worker, 8 threads, bound to socket/NUMA node 0",
        "rank 4 cpu2 R-worker, 8 threads, bound to socket/NUMA node 1"]
    (hosts,) = re.findall(r"^hosts file (\S+): gpu1 cpu1 cpu1 cpu2 cpu2$", proc.stdout, re.M)
    assert os.path.dirname(os.path.dirname(hosts)) == str(tmp_path)      # a directory of its own in $TMPDIR
    assert launch(proc.stdout) == (
        'launch: srun --mpi=pmix --ntasks=5 --distribution=arbitrary --cpu-bind=none --label bash -c "$RANK_WRAPPER" '
        "fastdecode-rank fastdecode generate -m smollm2-135m -i in\\ put.jsonl -o results.jsonl --r-threads 8 "
        "--max-batch 4096")
    assert "exec numactl --cpunodebind=$numa --membind=$numa" in proc.stdout
    # nothing left behind (the test's own wrapper and inputs only), nothing submitted
    assert not os.path.exists(hosts) and set(os.listdir(tmp_path)) == {"fdbin", "requests.jsonl", "in put.jsonl"}


def test_single_in_an_allocation_reads_it_from_scontrol(tmp_path):
    # a stand-in scontrol for an allocation of n[1-2] whose GPU is on n2: rank 0 goes there
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text("""#!/bin/bash
case "$1 $2" in
  "show hostnames") if [ "$3" = "n[1-2]" ]; then echo n1; echo n2; else echo "$3"; fi ;;
  "show job") echo "   Nodes=n1 CPU_IDs=0-3 Mem=0 GRES="; echo "   Nodes=n2 CPU_IDs=0-3 Mem=0 GRES=gpu:1(IDX:0)" ;;
  "show node") echo "NodeName=$3 Sockets=1 CoresPerSocket=4" ;;
  "show config") echo "TaskPlugin = task/none" ;;
esac
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = dict(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n[1-2]",
               FD_MPI_LAUNCHER="srun", FD_SRUN_MPI="pmi2")
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "pretend" not in proc.stdout
    assert layout(proc.stdout) == ["rank 0 n2 S-worker (the GPU)",
                                   "rank 1 n1 R-worker, 4 threads, bound to socket/NUMA node 0"]
    assert launch(proc.stdout) == ('launch: srun --mpi=pmi2 --ntasks=2 --distribution=arbitrary --label bash -c '
                                   '"$RANK_WRAPPER" fastdecode-rank fastdecode generate -m smollm2-135m -i '
                                   'requests.jsonl -o results.jsonl --r-threads 4')


def test_hetjob_pretend_allocation(tmp_path):
    proc = run(HETJOB, "--dry-run", tmp_path=tmp_path,
               env=dict(FD_DRY_GPU_NODE="g1", FD_DRY_NODES="c1 c2 c3", FD_DRY_SOCKETS="1", FD_DRY_CORES="32",
                        FD_SRUN_MPI="pmi2"))
    assert proc.returncode == 0, proc.stderr
    assert layout(proc.stdout) == ["rank 0 g1 S-worker (the GPU)"] + [
        f"rank {i} c{i} R-worker, 32 threads, bound to socket/NUMA node 0" for i in (1, 2, 3)]
    assert launch(proc.stdout) == ('launch: srun --het-group=0,1 --mpi=pmi2 --cpu-bind=none --label bash -c '
                                   '"$RANK_WRAPPER" fastdecode-rank fastdecode generate -m smollm2-135m -i '
                                   'requests.jsonl -o results.jsonl --r-threads 32')


def test_hetjob_tensor_parallel_s_ranks_on_the_gpu_node(tmp_path):
    # 3 S-ranks: the embedded model's 9 query and 3 KV heads split three ways (4 is refused, below)
    proc = run(HETJOB, "--dry-run", tmp_path=tmp_path,
               env=dict(FD_DRY_GPU_NODE="g1", FD_DRY_GPUS="3", FD_DRY_NODES="c1 c2", FD_DRY_SOCKETS="2",
                        FD_DRY_CORES="8", FD_SRUN_MPI="pmi2"))
    assert proc.returncode == 0, proc.stderr
    assert layout(proc.stdout) == [f"rank {r} g1 S-rank {r} of 3 (tensor-parallel), GPU {r}" for r in range(3)] + [
        f"rank {3 + i} c{1 + i // 2} R-worker, 8 threads, bound to socket/NUMA node {i % 2}" for i in range(4)]
    assert launch(proc.stdout).endswith("--r-threads 8 --tensor-parallel-size 3")
    assert "FD_S_RANKS=3" in proc.stdout
    proc = run(HETJOB, "--dry-run", tmp_path=tmp_path, env=dict(FD_DRY_GPUS="4"))
    assert proc.returncode == 2 and "--tensor-parallel-size 4 must divide the model's 9 query heads" in proc.stderr


def test_hetjob_data_parallel_groups_one_gpu_node_each(tmp_path):
    proc = run(HETJOB, "--dry-run", tmp_path=tmp_path,
               env=dict(FD_DATA_PARALLEL="2", FD_DRY_GPU_NODE="g1 g2", FD_DRY_GPUS="2", FD_DRY_NODES="c1 c2 c3",
                        FD_DRY_SOCKETS="1", FD_DRY_CORES="8", FD_SRUN_MPI="pmi2"))
    assert proc.returncode == 0, proc.stderr
    assert layout(proc.stdout) == ["rank 0 g1 S-worker of group 0 (the GPU)", "rank 1 g2 S-worker of group 1 (the GPU)",
                                   "rank 2 c1 R-worker of group 0, 8 threads, bound to socket/NUMA node 0",
                                   "rank 3 c2 R-worker of group 0, 8 threads, bound to socket/NUMA node 0",
                                   "rank 4 c3 R-worker of group 1, 8 threads, bound to socket/NUMA node 0"]
    assert launch(proc.stdout).endswith("--r-threads 8 --data-parallel-size 2") and "FD_S_RANKS=2" in proc.stdout
    assert "dry run: 2 data-parallel groups: ranks 0..1 are the 2 groups' S-workers" in proc.stdout
    # tensor-parallel groups: T = 3 S-ranks on each GPU node
    proc = run(HETJOB, "--dry-run", tmp_path=tmp_path,
               env=dict(FD_DATA_PARALLEL="2", FD_DRY_GPU_NODE="g1 g2", FD_DRY_GPUS="6", FD_DRY_NODES="c1 c2",
                        FD_DRY_SOCKETS="1", FD_SRUN_MPI="pmi2"))
    assert proc.returncode == 0, proc.stderr
    assert layout(proc.stdout)[:6] == [f"rank {r} g{1 + r // 3} S-rank {r % 3} of 3 (tensor-parallel) of group {r // 3}, "
                                       f"GPU {r % 3}" for r in range(6)], proc.stdout
    assert launch(proc.stdout).endswith("--tensor-parallel-size 3 --data-parallel-size 2")
    proc = run(HETJOB, "--dry-run", tmp_path=tmp_path, env=dict(FD_DATA_PARALLEL="2", FD_DRY_GPUS="3"))
    assert proc.returncode == 2 and "FD_DATA_PARALLEL=2 groups need a multiple of 2" in proc.stdout


# ---- the job's start-up checks, before the queue wait (generate --dry-run) -------------------

def check_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("check: "))


@pytest.mark.parametrize("script", [SINGLE, HETJOB])
def test_dry_run_checks_the_model_input_and_output(script, tmp_path):
    proc = run(script, "--dry-run", tmp_path=tmp_path, env=dict(FD_OUTPUT="done.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert check_line(proc.stdout).endswith("-o done.jsonl --r-threads 16 --dry-run")
    assert "dry run: model smollm2-135m: found and servable" in proc.stdout
    # examples/prompts.jsonl: five requests and a line the job answers with a 400 row
    assert "dry run: input requests.jsonl: 6 request lines; 1 would be an error row (the first: line 6:" in proc.stdout
    assert "dry run: output done.jsonl: new or empty" in proc.stdout
    assert not os.path.exists(tmp_path / "done.jsonl")        # a check writes nothing


@pytest.mark.parametrize("script", [SINGLE, HETJOB])
def test_dry_run_refuses_a_missing_model(script, tmp_path):
    proc = run(script, "--dry-run", tmp_path=tmp_path, env=dict(FD_MODEL="/m/llama"))
    assert proc.returncode == 2
    assert "fastdecode: error: model '/m/llama' not found" in proc.stderr
    assert layout(proc.stdout)                                   # the layout was still shown


def test_dry_run_refuses_a_model_not_in_the_hf_cache(tmp_path):
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path,
               env=dict(FD_MODEL="no-such-org/no-such-model", HF_HOME=str(tmp_path / "hf")))
    assert proc.returncode == 2
    assert "no-such-org/no-such-model" in proc.stderr and "cache" in proc.stderr, proc.stderr


def test_dry_run_refuses_a_missing_or_unparsable_input(tmp_path):
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path, env=dict(FD_INPUT="missing.jsonl"))
    assert proc.returncode == 2 and "fastdecode: error: input file missing.jsonl not found" in proc.stderr
    (tmp_path / "table.csv").write_text("id,prompt\n1,hello\n")
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path, env=dict(FD_INPUT="table.csv"))
    assert proc.returncode == 2
    assert "input file table.csv: none of its 2 lines is a request" in proc.stderr
    assert "line 1: not valid JSON" in proc.stderr


def test_dry_run_refuses_an_unwritable_or_foreign_output(tmp_path):
    proc = run(HETJOB, "--dry-run", tmp_path=tmp_path, env=dict(FD_OUTPUT="no/such/dir/out.jsonl"))
    assert proc.returncode == 2
    assert "fastdecode: error: output no/such/dir/out.jsonl: directory" in proc.stderr
    (tmp_path / "taken.jsonl").write_text('{"id": "x", "custom_id": "a"}\n')   # rows with no record of their input
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path, env=dict(FD_OUTPUT="taken.jsonl"))
    assert proc.returncode == 2
    assert "fastdecode: error: output taken.jsonl holds rows but no record" in proc.stderr
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path, env=dict(FD_OUTPUT="taken.jsonl", FD_EXTRA_ARGS="--overwrite"))
    assert proc.returncode == 0, proc.stderr
    assert "dry run: output taken.jsonl: --overwrite" in proc.stdout


def test_dry_run_without_the_program_says_so(tmp_path):
    proc = run(SINGLE, "--dry-run", tmp_path=tmp_path, env=dict(FASTDECODE_CMD="no-such-fastdecode"))
    assert proc.returncode == 2
    assert "FASTDECODE_CMD (no-such-fastdecode) does not run here" in proc.stdout
