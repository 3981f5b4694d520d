"""Running a ``@hydra.main`` function: the arguments normalised, Hydra's refusals caught where
Hydra reports them, each said as looplib's one line.

Hydra runs everything it does for a command line (composing the config, parsing overrides,
launching the jobs) through one function, ``hydra._internal.utils.run_and_report``, which
prints an error and exits 1 (or, with ``HYDRA_FULL_ERROR=1``, lets it through). ``run`` takes
the place of that function while a command runs: a refusal raised *before* a job starts (an
unknown option, an argument that does not parse, an ambiguous value without ``-m``) comes back
here, where Hydra's advice is followed when it asks for a "+" (``looplib.cli.args``), and what
remains is one line, exit status 2, nothing written. Exceptions raised *inside* a job are
reported by Hydra as always. ``HYDRA_FULL_ERROR`` keeps Hydra's meaning: unset or ``0``,
looplib's line; ``1``, Hydra's full report.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from ..process import this
from ..process.launcher import launched_rank, launched_world, strip_launcher_args
from ..errors import EXIT_CONFIG, Interrupted
from ..store import rundir
from ..run.endings import refused_line
from .args import explain, follow_advice, normalise

FULL_ERROR = "HYDRA_FULL_ERROR"


class Refused(BaseException):
    """Hydra refused the command line before a job started (a BaseException: Hydra's own
    ``run_and_report``, which catches ``Exception``, lets it through to ``run``)."""

    def __init__(self, err: BaseException):
        super().__init__(str(err))
        self.err = err


class Boundary:
    """What ``run`` knows while a command runs: whether a job is running (its exceptions are the
    job's own) and the sweep directory this command made (removed when it is refused)."""

    def __init__(self):
        self.in_job = False
        self.sweep_dir: Path | None = None
        self.sweep_fresh = False
        self.held: tuple[Path, dict] | None = None  # an existing run directory's Hydra files, before this command
        self.before_job_files: Callable[[], None] | None = None  # RunDirGuard.hold_job_dir

    def report(self, original: Callable) -> Callable:
        """Hydra's ``run_and_report``, but a refusal before a job is raised to ``run``."""
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        def run_and_report(func):
            def refusals_raised():
                try:
                    return func()
                except (HydraException, OmegaConfBaseException) as err:
                    if self.in_job:  # the job's own: reported by Hydra as it always is
                        raise
                    raise Refused(err) from err
            return original(refusals_raised)
        return run_and_report

    def saving(self, original: Callable) -> Callable:
        """Hydra's ``_save_config``, but ``before_job_files`` is called before a job's first file
        (``.hydra/config.yaml``): Hydra writes a sweep job's ``.hydra/`` before any callback runs."""
        def save_config(cfg, filename, output_dir):
            if filename == "config.yaml" and self.before_job_files is not None:
                self.before_job_files()
            return original(cfg, filename, output_dir)
        return save_config

    def forget_sweep(self) -> None:
        """A sweep refused before any job wrote a result leaves no directory behind."""
        path, self.sweep_dir = self.sweep_dir, None
        if path is not None and self.sweep_fresh and not rundir.results(path):
            rundir.forget(path, fresh=True)


BOUNDARY = Boundary()  # set by RunDirGuard (looplib.cli.guard) as jobs start and end


@contextlib.contextmanager
def hydra_boundary():
    """Hydra's reporting function replaced by ``BOUNDARY.report``, and its writer of a job's
    ``.hydra/`` by ``BOUNDARY.saving`` (where Hydra calls them)."""
    import hydra._internal.utils as hydra_utils
    import hydra.core.utils as hydra_core
    original, save_config = hydra_utils.run_and_report, hydra_core._save_config
    hydra_utils.run_and_report = BOUNDARY.report(original)
    hydra_core._save_config = BOUNDARY.saving(save_config)
    try:
        yield
    finally:
        hydra_utils.run_and_report, hydra_core._save_config = original, save_config
        BOUNDARY.in_job = False


def refuse(line: str) -> None:
    """A refusal before the job: said by the rank that refuses (identical lines from several ranks
    once: ``looplib.process.board``), its status in ``LOOPLIB_EXIT_FILE``, exit status 2."""
    if this().board.post_refusal(line):
        print(line, file=sys.stderr, flush=True)
    rundir.write_exit_status(EXIT_CONFIG, every_rank=True)
    this().board.heard()  # the other ranks know why before the launcher stops them
    sys.exit(EXIT_CONFIG)


@contextlib.contextmanager
def stopped_before_the_job():
    """Under a launcher, a signal before the job starts (the launcher stopping this rank because
    another one exited) ends in looplib's line, not a silent death: the rank that refused, if one
    did (``looplib.process.board``), else the signal. The job's own handler replaces this one."""
    if launched_world()[0] <= 1:
        yield
        return

    def stop(signum, frame):
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    except Interrupted as end:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # on its way out: a second signal changes nothing
        peer = this().board.refusal()
        line = refused_line(peer.rank) if peer is not None else \
            f"looplib: stopped ({end}) before training started; nothing was saved"
        if this().board.says(line):
            print(line, file=sys.stderr, flush=True)
        status = (peer or end).status
        rundir.write_exit_status(status)
        sys.exit(status)
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is stop:
                signal.signal(sig, handler)


def run(main: Callable[[], None], argv: list[str] | None = None) -> None:
    """Run a ``@hydra.main`` function on ``argv`` (default ``sys.argv[1:]``), normalised; Hydra's
    refusals end as one line and exit status 2 (``HYDRA_FULL_ERROR=1``: Hydra's own report)."""
    from hydra.core.global_hydra import GlobalHydra

    args = normalise(strip_launcher_args(list(sys.argv[1:] if argv is None else argv)))
    if launched_world()[0] > 1 and launched_rank() != 0:  # one voice: Hydra's launch lines from rank 0 only
        for name in ("hydra", "hydra_plugins"):
            logging.getLogger(name).setLevel(logging.WARNING)
    prog, saved_argv, tried = sys.argv[0], list(sys.argv), set()
    try:
        while True:  # each retry follows one piece of Hydra's advice, never the same arguments twice
            tried.add(tuple(args))
            sys.argv = [prog, *args]
            try:
                with stopped_before_the_job(), hydra_boundary():
                    main()
                return
            except Refused as refused:
                BOUNDARY.forget_sweep()
                fixed = follow_advice(str(refused.err), args)
                if fixed is None or tuple(fixed) in tried:
                    if os.environ.get(FULL_ERROR) == "1":
                        raise refused.err from None
                    refuse(f"looplib: error: {explain(refused.err)}")
                args = fixed
                GlobalHydra.instance().clear()
            except SystemExit as stop:
                if stop.code not in (0, None):
                    BOUNDARY.forget_sweep()
                raise
    finally:
        sys.argv = saved_argv
