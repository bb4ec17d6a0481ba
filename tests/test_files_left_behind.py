"""Issue 53, item 8: a job leaves nothing it need not leave. The output's lock goes when its
holder ends (the lock is the open descriptor), the side files a job keeps beside its output are
ignored by git (the README's own job writes out.jsonl in the clone), and the SLURM scripts'
hosts files live in a directory of their own, never under a fixed name in a shared /tmp."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from conftest import REPO
from test_slurm_dry_run import HETJOB, SINGLE, run

from fastdecode.batch import lock
from fastdecode.batch.sidefiles import SUFFIXES

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def hold_then(path: str, end: str) -> subprocess.CompletedProcess:
    """A process that takes the lock at `path` and ends by `end` (a statement)."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from fastdecode.batch import lock
        assert lock.hold({path!r}, "output out.jsonl")
        assert os.path.exists({path!r})
        {end}""")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, timeout=120, check=False)


def test_the_lock_file_goes_when_its_job_ends(tmp_path):
    path = str(tmp_path / "out.jsonl.lock")
    for end in ("pass", "sys.exit(75)", "raise SystemExit(2)"):
        proc = hold_then(path, end)
        assert proc.returncode in (0, 75, 2)
        assert not os.path.exists(path), end
    killed = hold_then(path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL and os.path.exists(path)     # the kernel lets go, the file stays
    assert hold_then(path, "pass").returncode == 0 and not os.path.exists(path)   # the next job takes and removes it


def test_a_lock_file_removed_as_it_is_taken_is_taken_afresh(tmp_path, monkeypatch):
    """A job that opened the lock file just as its holder removed it must not hold the removed
    file's lock (a third job would take a new file at the path): it locks the file at the path."""
    path = str(tmp_path / "out.jsonl.lock")
    real_flock, calls = lock.fcntl.flock, []

    def flock_after_the_holder_left(fd, op):
        if not calls:
            os.unlink(path)                    # the holder ends between this job's open and its flock
        calls.append(fd)
        return real_flock(fd, op)
    monkeypatch.setattr(lock.fcntl, "flock", flock_after_the_holder_left)
    try:
        assert lock.hold(path, "output out.jsonl")
        held = os.fstat(lock._held[path])
        now = os.stat(path)
        assert (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino) and len(calls) == 2
    finally:
        lock.release_all()
    assert not os.path.exists(path)


def test_the_side_files_of_an_output_in_the_clone_are_ignored_by_git():
    names = ["out.jsonl" + suffix for suffix in SUFFIXES] + \
        ["out.jsonl.rewrite.k2x9q0zz.tmp", "out.jsonl.inflight.a1b2c3d4.tmp", "out.jsonl.fingerprints.zz99yy88.tmp",
         "out.jsonl.summary.json", "results/mine.jsonl.fingerprints"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *names], cwd=REPO, capture_output=True, text=True,
                          check=False)
    assert sorted(proc.stdout.split()) == sorted(names), proc.stdout + proc.stderr


def test_the_dry_run_hosts_file_is_not_a_fixed_name(tmp_path):
    """A fixed name in a shared /tmp is another user's to plant: a link there would have the dry
    run overwrite (then remove) the file it points to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    for script in (SINGLE, HETJOB):
        planted = tmp_path / "fastdecode-hosts.dry-run"
        planted.symlink_to(victim)
        proc = run(script, "--dry-run", tmp_path=tmp_path, env=dict(FD_DRY_NODES="cpu1 cpu2"))
        assert proc.returncode == 0, proc.stderr
        assert victim.read_text() == "keep me\n" and planted.is_symlink()
        hosts = [line.split(":")[0].split()[-1] for line in proc.stdout.splitlines() if line.startswith("hosts file ")]
        assert all(not h.endswith(".dry-run") and os.path.dirname(os.path.dirname(h)) == str(tmp_path)
                   for h in hosts), proc.stdout
        assert hosts or script == HETJOB           # the hetjob's layout is srun's: it names no hosts file
        planted.unlink()
        # nothing left behind: the victim, and the dry run's own wrapper and default input
        assert sorted(os.listdir(tmp_path)) == ["fdbin", "requests.jsonl", "victim.txt"]
