"""`fastdecode generate` run inside the test process on an engine the tests already hold: the
same path as the command (batch/generate.run_generate) without a model load or a process start
per run. A stop is asked for at a chosen engine step instead of by a signal."""
from __future__ import annotations

from fastdecode.batch.generate import run_generate
from fastdecode.cli import build_parser


class Borrowed:
    """An engine lent to one run: the run's close() leaves it open for the next."""

    def __init__(self, engine):
        self.__dict__["_engine"] = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


class StepStop:
    """A stop request that turns true once the engine has run `at` steps of this run (never with
    at=None)."""

    def __init__(self, at: int | None = None, name: str = "SIGUSR1"):
        self.at, self.name, self.engine, self.first_step = at, name, None, 0

    def attach(self, engine) -> None:
        self.engine, self.first_step = engine, engine.step_no

    @property
    def requested(self) -> bool:
        return self.at is not None and self.engine is not None and self.engine.step_no - self.first_step >= self.at

    def watch(self, on_first) -> None:
        pass


def drain(engine) -> None:
    """Finish what a stopped run left in the engine (its results unused), so the next run starts
    from an idle engine as a new process would."""
    while engine.has_unfinished():
        engine.step()


def generate(engine, argv: list[str], stop_at: int | None = None) -> tuple[dict | None, dict, int]:
    """run_generate for `generate ARGV` (--quiet added) on `engine`, left idle after it; stop_at:
    stop after that many steps. -> (this run's summary, the run report, the exit code)."""
    args = build_parser().parse_args(["generate", "--quiet"] + argv)
    stop = StepStop(stop_at)

    def make_engine():
        stop.attach(engine)
        return Borrowed(engine)
    try:
        return run_generate(make_engine, args, stop)
    finally:
        drain(engine)
