"""Name a rank that dies.

A process killed by the OOM killer, a segfault or `kill -9` cannot say who it was, and MPI
launchers report the processes they clean up afterwards, not the one that died first. So under
an MPI launcher each `fastdecode` rank runs as a child of a small supervisor (this module, no
MPI and no torch): the supervisor forwards signals to the child, and if the child ends
abnormally it prints which rank died and how, then exits with the child's code so the launcher
ends the job.

A child that dies before MPI is up on every rank (it says so on a pipe once it is) leaves the
others waiting in MPI_Init, which no launcher ends at once: its supervisor joins MPI in its place
and aborts the job (start_abort.py).

Signals that arrive before the child has installed its own handlers are held (the child starts
with them blocked) and delivered then, so a stop during start-up is a stop, not a kill.
If the supervisor itself dies (SIGKILL: it forwards every other stop signal), the child ends too,
saying so (the kernel sends it SIGUSR2, PR_SET_PDEATHSIG; a thread that sees its parent change
ends it where the handler cannot run), so no orphaned rank holds the job open. Rows written so
far stay. A SIGUSR2 from anyone else, while the supervisor is still its parent, is ignored.

The run report must not say "running" after any of that. The supervisor of a dead R-worker
reports it to rank 0 (rworker/host/end_notice.py: the child passes rank 0's address up a pipe),
which marks its report failed naming the rank and aborts the job with exit 1; an R-worker whose
supervisor was killed too is found by the link that supervisor held open to rank 0 (closed
without a bye), with the same result; rank 0's own supervisor marks the report failed when rank 0
ends abnormally; and rank 0, ended because its supervisor was killed, writes the report prepared
for that (batch/orphan_note.py: "failed", or "interrupted" once a stop signal came) with plain system
calls before it exits, or "failed" naming an R-worker whose link it finds closed then (on_orphan).
The report comes first there: a message to a launcher that has gone (a broken pipe) must not cost it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ENV_FLAG = "FASTDECODE_SUPERVISED"        # set in the child: the supervisor's pid
PR_SET_PDEATHSIG = 1
ORPHAN_SIGNAL = signal.SIGUSR2            # what the child gets when its supervisor dies
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
CLEAN_EXITS = (0, 2, 75)      # done, usage error, interrupted with work saved
WAIT_FOR_ABORT_S = 10.0       # after rank 0 recorded this rank's death: its abort ends this process


def should_supervise() -> bool:
    from fastdecode.launch.ranks import launched_size
    return launched_size() > 1 and not os.environ.get(ENV_FLAG) and \
        os.environ.get("FASTDECODE_NO_SUPERVISOR") != "1"


def run_supervised(argv: list[str], summary_path: str | None = None) -> int:
    from fastdecode.batch.interrupt import STOP
    from fastdecode.launch.ranks import launched_rank, role_name
    from rworker.host.end_notice import SUPERVISOR_FD, SupervisorLink
    from fastdecode.launch import launcher_watch
    rank, started = launched_rank(), time.time()
    launcher = launcher_watch.find() if rank == 0 else None     # noted while it runs: report_end asks
    from_child, to_supervisor = os.pipe()          # the child passes rank 0's address up
    os.set_inheritable(to_supervisor, True)
    env = dict(os.environ, **{ENV_FLAG: str(os.getpid()), SUPERVISOR_FD: str(to_supervisor)})
    # The child starts with the stop signals blocked (a mask survives exec) and unblocks them once
    # its own handlers are in: a signal forwarded meanwhile waits for them instead of killing it.
    # Its own process group: a launcher that signals the group reaches it only through this
    # forwarding. close_fds=False: the launcher's PMI connection (PMI_FD) must reach the child.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        child = subprocess.Popen([sys.executable, "-m", "fastdecode"] + argv, env=env, close_fds=False,
                                 process_group=0)
    finally:
        os.close(to_supervisor)
        for sig in FORWARDED:       # R-workers ignore stop signals (rank 0 shuts them down)
            signal.signal(sig, signal.SIG_IGN if rank > 0 else
                          (lambda signum, _frame: child.send_signal(signum)))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    if rank == 0 and STOP.requested:      # received before the child existed (cli.main took it)
        child.send_signal(STOP.signum)
    # an R-worker's supervisor links to rank 0 as soon as the child knows its address: if this
    # process is killed, rank 0 sees the link close and names the rank
    link = SupervisorLink(from_child, rank, f"rank {rank} ({role_name(rank)} pid {child.pid} on "
                                            f"{socket.gethostname()})" if rank > 0 else None)
    code = child.wait()                   # retried after each forwarded signal (PEP 475)
    if code not in CLEAN_EXITS:
        report_end(rank, child.pid, code, link.address() if rank > 0 else None, summary_path, started, launcher)
        if not link.saw_mpi_up():         # the other ranks wait in MPI_Init, where no launcher ends them
            from fastdecode.launch.start_abort import end_ranks_waiting_in_mpi_init
            end_ranks_waiting_in_mpi_init(1)
    link.bye()
    return 128 - code if code < 0 else code


def report_end(rank: int, pid: int, code: int, rank0_address: dict | None, summary_path: str | None,
               started: float, launcher=None) -> None:
    """A child that ended abnormally: name it on stderr (unless it did: exit code 1), and in the run
    report, through rank 0 (an R-worker) or directly (rank 0); rank 0 ended because the launcher
    died (launcher_watch) is reported as that."""
    from fastdecode.launch import launcher_watch
    from fastdecode.launch.ranks import role_name
    if rank == 0 and summary_path and code != 1 and launcher_watch.gone(launcher):
        from fastdecode.batch.report_file import mark_file_failed
        mark_file_failed(summary_path, launcher_watch.died_text(launcher), None, started)
        return
    who = f"rank {rank} ({role_name(rank)} pid {pid} on {socket.gethostname()})"
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if code != 1:                         # 1: the child reported its own failure already
        print(f"fastdecode: {who} died: {how}", file=sys.stderr, flush=True)
    if rank == 0 and summary_path:
        from fastdecode.batch.report_file import mark_file_failed
        mark_file_failed(summary_path, f"{who} died: {how}" if code != 1 else f"{who} failed (see its message)",
                         code if code == 1 else launcher_exit_code(code, launcher_name()), started)
    elif rank > 0 and code != 1 and rank0_address is not None:
        from rworker.host.end_notice import send
        if send(rank0_address, {"rank": rank, "error": f"{who} died: {how}", "code": 1, "abort": True}):
            time.sleep(WAIT_FOR_ABORT_S)  # rank 0 aborts the job with exit 1: the launcher ends this process


# the process that starts a rank's supervisor, by launcher: its name, and what the launcher exits with
# once a rank's process ended abnormally (its code, or -N: killed by signal N)
_HYDRA = ("hydra_pmi_proxy",)                       # MPICH's and Intel MPI's mpiexec
_OPEN_MPI = ("orted", "prted", "mpirun", "mpiexec", "orterun", "prterun")


def launcher_name() -> str | None:
    """The name of the launcher's process that started this rank's supervisor (its daemon on this
    node), asked in the supervisor or in its child."""
    try:
        import psutil
        parent = psutil.Process(os.getppid())
        if os.environ.get(ENV_FLAG):            # a supervised child: the launcher started its parent
            parent = parent.parent()
        return parent.name() if parent is not None else None
    except Exception:  # noqa: BLE001 - unknown is an answer
        return None


def launcher_exit_code(code: int, launcher: str | None) -> int | None:
    """What the launcher will exit with after rank 0's process ended abnormally with `code`, for
    the run report (None: a launcher whose answer is not known). Measured: MPICH's hydra kills every
    process of the job once a rank ends without MPI_Finalize and exits 9 (SIGKILL's number), whatever
    the rank's code; Open MPI's mpirun exits with the process's status (this supervisor exits 128 + N
    for a child killed by signal N, as a shell does)."""
    if launcher in _HYDRA:
        return int(signal.SIGKILL)
    if launcher in _OPEN_MPI:
        return 128 - code if code < 0 else code
    return None


def _write_orphan_note() -> None:
    """Plain system calls only (and the check's peek at rank 0's links): this runs in a signal
    handler or as the process ends."""
    from fastdecode.batch.orphan_note import pending
    found = None
    note, check = pending()
    if note is not None and check is not None:
        try:
            found = check()
        except Exception:  # noqa: BLE001 - the prepared note still goes out
            pass
    note, _ = pending()                  # read after the check: a listener thread may have written meanwhile
    if note is None:
        return
    path, data = note[0], found or note[1]
    tmp = f"{path}.orphaned.{threading.get_ident()}.tmp"     # the handler and the watch thread may both write
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        pass


def child_started(rank: int) -> None:
    """In a supervised child, once its own answers to the stop signals are in: let the signals
    held since its start through, and make the kernel end this process if the supervisor dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    supervisor = int(os.environ.get(ENV_FLAG) or 0)
    if not supervisor:
        return
    from fastdecode.launch.ranks import role_name
    host = socket.gethostname()

    def orphaned(*_) -> None:
        try:                             # whatever goes wrong on the way, the process ends
            _write_orphan_note()         # first: stderr may be a pipe to a launcher that is gone
            try:                         # the role once the command line is read (a tensor-parallel rank's)
                os.write(2, f"fastdecode: rank {rank} ({role_name(rank)} pid {os.getpid()} on {host}): its "
                            f"supervisor (pid {supervisor}) died; ending this rank\n".encode())
            except OSError:
                pass
        finally:
            os._exit(1)

    def on_signal(*_) -> None:
        # the kernel's PDEATHSIG comes after this process was given to another parent; a SIGUSR2
        # sent by anyone else while the supervisor lives is no death
        if os.getppid() == supervisor:
            try:
                os.write(2, f"fastdecode: rank {rank}: got {ORPHAN_SIGNAL.name}, but its supervisor (pid "
                            f"{supervisor}) is alive: ignored\n".encode())
            except OSError:
                pass
            return
        orphaned()

    signal.signal(ORPHAN_SIGNAL, on_signal)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(ORPHAN_SIGNAL), 0, 0, 0)
    threading.Thread(target=_watch_parent, args=(supervisor, orphaned), name="supervisor-watch", daemon=True).start()


def _watch_parent(supervisor: int, orphaned) -> None:
    while os.getppid() == supervisor:
        time.sleep(1.0)
    time.sleep(1.0)                      # the signal's handler speaks first where it can run
    orphaned()
