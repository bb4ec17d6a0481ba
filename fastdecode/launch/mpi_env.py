"""MPI roles and failure handling: rank 0 is the S-worker, ranks 1..R are R-workers (with a
tensor-parallel S-worker of T ranks: ranks 0..T-1 the S-worker, T..T+R-1 the R-workers).

An uncaught exception on any rank must end the whole job (COMM_WORLD.Abort) with a message
naming the rank, never leave the others waiting forever.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys

from fastdecode.launch.ranks import SIZE_VARS, launched_rank, launched_size, role_name


def under_launcher() -> bool:
    """Whether an MPI launcher (or srun) started this process, whatever the number of ranks."""
    return any(var in os.environ for var in SIZE_VARS) or "SLURM_STEP_NUM_TASKS" in os.environ


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)   # batch/interrupt.py's
INIT_TIMEOUT_S = 300.0    # MPI start-up waits for every rank; a rank that never comes ends it


def world(init_timeout: float | None = None):
    """COMM_WORLD, or None when this process runs alone without an MPI launcher or without mpi4py.

    Under a launcher MPI_Init waits for every rank, inside C code that holds the interpreter: if a
    rank died before it got there, no Python timer could run and the job would wait forever. A
    faulthandler watchdog (its own C thread) ends this process after `init_timeout` seconds,
    printing where it waited (--timeout, at least 30 s; 300 s without one)."""
    if launched_size() <= 1:
        try:
            from mpi4py import MPI
        except ImportError:
            return None
        return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None
    check_library_before_init()
    timeout = max(init_timeout, 30.0) if init_timeout else INIT_TIMEOUT_S
    # MPICH's start-up installs its own handlers for the stop signals, and one arriving meanwhile
    # would end the process: hold them until MPI is up, give back this process's own answers to
    # them, then let what arrived meanwhile through
    own = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        comm.Barrier()                    # every rank is past MPI_Init
    finally:
        faulthandler.cancel_dump_traceback_later()
        for sig, handler in own.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if comm.Get_size() == 1:     # mixed MPIs: mpi4py's library cannot reach the launcher, so every
        # rank starts alone, each a rank 0 of a world of 1
        from fastdecode.launch.info import loaded_libmpi
        mixed_mpi_exit(mixed_mpi_message(1, MPI.Get_library_version(), origin=MPI.__file__,
                                         lib_path=loaded_libmpi()))
    from rworker.host.notice_link import tell_supervisor_mpi_up
    tell_supervisor_mpi_up()              # a death from here on is one the launcher acts on
    return comm


EXIT_USAGE = 2
_LAUNCHERS = (("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun", "Open MPI"),
              ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun_rsh", "MPICH"),
              ("PMI_SIZE", "a Hydra mpiexec (MPICH, Intel MPI) or srun --mpi=pmi2", "MPICH"),
              ("PMIX_RANK", "a PMIx launcher (srun --mpi=pmix, Open MPI 5's mpirun)", None),
              ("SLURM_STEP_NUM_TASKS", "srun", None))


def check_library_before_init() -> None:
    """Under Open MPI's launcher, an MPICH-family mpi4py aborts inside MPI_Init (it finds PMIx, not
    its PMI): ask the library mpi4py would load, without starting it, and stop first, saying why."""
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return
    from fastdecode.launch.info import library_before_init, library_family
    found = library_before_init()
    if found and library_family(found[0]) not in (None, "Open MPI"):
        mixed_mpi_exit(mixed_mpi_message(None, found[0], origin=found[1], lib_path=found[2]))


def mixed_mpi_exit(message: str):
    """Every rank knows; rank 0 says it, the others wait a little so that their exit, which ends
    the job, does not cut it short."""
    if launched_rank() == 0:
        print(f"fastdecode: error: {message}", file=sys.stderr, flush=True)
    else:
        import time
        time.sleep(2.0)
    raise SystemExit(EXIT_USAGE)


def mixed_mpi_message(world_size: int | None, library_version: str, env=None, origin: str | None = None,
                      lib_path: str | None = None) -> str:
    """The launcher started ranks that mpi4py's MPI library cannot join (world_size: what it saw,
    1; None: it cannot start): the launcher and the library are different MPIs, or srun ran
    without an MPI plugin. Names both and the fixes."""
    from fastdecode.launch.info import dual_abi_hint, library_family
    env = os.environ if env is None else env
    var, launcher, launcher_family = next(((v, name, fam) for v, name, fam in _LAUNCHERS if v in env),
                                          ("", "the launcher", None))
    size = next((env[v] for v in SIZE_VARS + ("SLURM_STEP_NUM_TASKS",) if v in env), "?")
    first = library_version.strip().splitlines()[0] if library_version.strip() else "unknown"
    library = " ".join(first.split(",")[0].split())
    family = library_family(library_version) or library
    said = f" ({var}={env[var]})" if var else ""
    fixes = [f"launch with {family}'s own mpiexec/mpirun"]
    if var == "SLURM_STEP_NUM_TASKS":
        fixes.insert(0, "give srun the MPI plugin: srun --mpi=pmix or --mpi=pmi2 (srun --mpi=list)")
    if launcher_family and (hint := dual_abi_hint(origin, launcher_family)):
        fixes.append(hint)
    target = launcher_family or "the launcher's MPI"
    fixes.append(f"rebuild mpi4py against {target} (MPICC=<its mpicc> python3 -m pip install --no-binary=mpi4py "
                 "--no-cache-dir --force-reinstall mpi4py)")
    saw = f"which sees a world of {world_size}" if world_size else "which cannot start under it"
    return (f"{launcher} started {size} ranks{said}, but mpi4py's MPI library is {library}"
            f"{f' ({lib_path})' if lib_path else ''}, {saw}: the launcher and mpi4py must be the same MPI. "
            f"Fix: {'; or '.join(fixes)}. `fastdecode info` shows both; docs/site_mpi.md has the details")


EXIT_TEMPFAIL = 75        # EX_TEMPFAIL: outputs saved, rerun me (the SLURM scripts requeue on it)


def share_end_notices(comm) -> dict | None:
    """Collective, at start-up: rank 0 listens for end notices (rworker/host/end_notice.py) on the
    addresses the ranks reach it by, and every other rank passes the address it was given to its
    supervisor. Returns the address (None on rank 0)."""
    from rworker.host import end_notice
    where = comm.gather(end_notice.whereabouts(), root=0)
    if comm.Get_rank() == 0:
        from fastdecode.launch import launcher_watch
        from fastdecode.batch.orphan_note import on_orphan
        from fastdecode.launch.supervise import launcher_exit_code, launcher_name
        hosts = end_notice.listen_hosts(where)             # per rank: rank 0's addresses towards it
        # a lost rank's supervisor was killed (SIGKILL): what the launcher exits with then, for the report
        lost_code = launcher_exit_code(-int(signal.SIGKILL), launcher_name())
        launcher = launcher_watch.find()                   # ranks lost because it died are no rank's death
        listener = end_notice.Listener(lambda notice: on_end_notice(comm, notice, lost_code, launcher),
                                       hosts=[h for per_rank in hosts for h in per_rank] or ["127.0.0.1"],
                                       ranks=comm.Get_size() - 1)
        on_orphan(lambda: lost_rank_report(listener, lost_code, launcher=launcher))
        comm.scatter([None] + [listener.address(h) for h in hosts[1:]], root=0)
        return None
    address = comm.scatter(None, root=0)
    end_notice.tell_supervisor(address)
    return address


def on_end_notice(comm, notice: dict, lost_code: int | None = None, launcher=None):
    """Rank 0, on the listener's thread: a rank failed (it aborts the job itself) or died. The run
    report names it before the job ends; for a dead rank this returns the abort (exit 1), which
    runs once the notice is answered. Ranks lost because the launcher (launcher_watch.find())
    died first are reported as that, with no exit code: the launcher's status is not rank 0's to know."""
    from fastdecode.batch.interrupt import STOP
    from fastdecode.batch.report import fail_live
    try:
        rank = int(notice["rank"]) if notice["rank"] is not None or not notice.get("lost") else None
        error, code = str(notice["error"]), int(notice.get("code", 1))
    except (KeyError, TypeError, ValueError):
        return None
    if notice.get("lost") and STOP.requested:
        return None          # the launcher ending every rank after a stop signal (Open MPI): no death
    died = launcher_died(launcher) if notice.get("lost") else None
    if died:
        error, rank, lost_code = died, None, None
    if notice.get("lost"):   # the launcher saw its process killed: the job's exit code is the launcher's
        if fail_live(error, rank, lost_code):
            print(f"fastdecode: {error}", file=sys.stderr, flush=True)     # no supervisor left to say it
    else:
        fail_live(error, rank, code)
    if not notice.get("abort"):
        return None
    from rworker.host.wait import abort_job
    return lambda: abort_job(comm, code)


def launcher_died(launcher) -> str | None:
    """The report's error where the launcher noted at start-up has ended, else None."""
    from fastdecode.launch import launcher_watch
    return launcher_watch.died_text(launcher) if launcher_watch.gone(launcher) else None


def lost_rank_report(listener, lost_code: int | None = None, settle_s: float = 1.0, launcher=None) -> bytes | None:
    """Rank 0, ended because its supervisor was killed: the report failed saying the launcher died
    (launcher_watch), else, if R-worker links to rank 0 have closed without a bye, naming the rank
    (one closed) or the ranks (the launcher killed them together). The listener's threads get a
    moment to write it themselves."""
    import time

    from fastdecode.batch.interrupt import STOP
    from fastdecode.batch.report import failed_note, live_running
    if STOP.requested:
        return None
    died = launcher_died(launcher)
    if died:
        return failed_note(died, None, None)
    if not listener.gone():
        return None
    deadline = time.monotonic() + settle_s
    while live_running() and time.monotonic() < deadline:
        time.sleep(0.02)
    notice = listener.lost_notice()
    return failed_note(notice["error"], notice["rank"], lost_code) if notice is not None else None


def _is_config_error(exc: BaseException) -> bool:
    try:
        from fastdecode.model.config import ConfigError
    except ImportError:
        return False
    return isinstance(exc, ConfigError)


def fail(comm, exc: BaseException, code: int = 1) -> None:
    """Print one line naming this rank and end the whole job. A silent peer (a stuck or lost
    node) ends it with EX_TEMPFAIL so that a batch system requeues it; outputs are on disk."""
    from rworker.host.wait import PeerTimeout
    if isinstance(exc, PeerTimeout):
        code = EXIT_TEMPFAIL
    elif _is_config_error(exc):          # a model found unservable only as it loads: still a usage error
        code = EXIT_USAGE
    rank = comm.Get_rank() if comm is not None else 0
    where = f"rank {rank} ({role_name(rank)} on {socket.gethostname()}) failed" if comm is not None else "failed"
    print(f"fastdecode: {where}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    if comm is not None and comm.Get_size() > 1:
        from rworker.host.wait import abort_job
        abort_job(comm, code)
    sys.exit(code)
