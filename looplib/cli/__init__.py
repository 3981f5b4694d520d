"""The command line: the only part of looplib that imports Hydra or OmegaConf.

    entry        running a ``@hydra.main`` function: arguments settled first, a refusal as one line
    args         both spellings of a group, the forgiving ``+``, Hydra's refusals found first (public API only)
    main         ``python -m looplib.train``: the config -> a typed JobSpec -> looplib.run.session.Session
    instantiate  every key checked, group defaults, each group instantiated, trackers built
    resolvers    the ``${looplib.*}`` interpolations of conf/
    guard        ``RunDirGuard``: the run directory checked and held before anything is written; the job's ``.hydra/``
    record       the job's ``.hydra/`` record: its name, its overrides read back (Hydra-free: looplib.report)
    sweep        what a sweep's job returns to its sweeper; the grid sweep's pre-check; pruning
    plan, tune, generate   ``python -m looplib.plan`` / ``.tune`` / ``.generate``'s command lines
"""
from __future__ import annotations

import logging


class BelowWarning(logging.Filter):
    """Log records under WARNING only: progress and metrics on stdout, the rest on stderr
    (conf/hydra/job_logging/looplib.yaml)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def run(main, argv: list[str] | None = None) -> None:
    """``looplib.cli.entry.run``: a ``@hydra.main`` function run on the settled command line."""
    from .entry import run as run_entry
    run_entry(main, argv)


def train() -> None:
    """The ``looplib-train`` console script: ``python -m looplib.train``, the same arguments."""
    from .main import main
    try:
        run(main)
    except SystemExit as stop:
        leave(stop.code)
    leave(0)


def leave(code) -> None:
    """Exit with ``code`` (as ``sys.exit`` takes it). One rank of several (``WORLD_SIZE`` > 1) runs
    its exit handlers and ends without the interpreter's finalisation: there gloo's C++ threads,
    still joinable after every process group was destroyed, aborted a rank now and then
    ("terminate called without an active exception", exit -6 under torchrun; seen in CI), so a
    run or sweep that finished would be reported failed."""
    import os
    import sys
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    import atexit
    atexit._run_exitfuncs()  # what the interpreter would run first: trackers, joblib, temporary files
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
