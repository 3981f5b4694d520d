"""Running a ``@hydra.main`` function: the arguments settled and checked before Hydra sees them,
each refusal said as looplib's one line.

``looplib.cli.args.settle`` writes each group the way Hydra wants it, decides the ``+`` of each key
from the composed config, and finds what Hydra would refuse (an unknown option, an argument that
does not parse, several values without ``-m``, a typo in Hydra's own nodes) with Hydra's public API
(``OverridesParser``, ``hydra.compose``, the config repository's groups and options) and the
exceptions' types. What it refuses is one line, exit status 2, nothing written: Hydra has not
started. ``HYDRA_FULL_ERROR`` keeps Hydra's meaning: unset or ``0``, looplib's line; ``1``, the
command line goes to Hydra as it stands, and Hydra reports its own error in full. Exceptions
raised inside a job are reported by Hydra as always.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Callable

from ..process import this
from ..process.launcher import launched_rank, launched_world, strip_launcher_args
from ..errors import EXIT_CONFIG, Interrupted
from ..store import rundir
from ..run.endings import refused_line
from .args import Refusal, settle

FULL_ERROR = "HYDRA_FULL_ERROR"


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
    """Run a ``@hydra.main`` function on ``argv`` (default ``sys.argv[1:]``), settled; a refused
    command line ends as one line and exit status 2 (``HYDRA_FULL_ERROR=1``: Hydra's own report)."""
    args = strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    try:
        args = settle(args)
    except Refusal as refused:
        if os.environ.get(FULL_ERROR) != "1":
            refuse(f"looplib: error: {refused.line}")
        args = refused.args_so_far  # Hydra refuses it itself, in full
    if launched_world()[0] > 1 and launched_rank() != 0:  # one voice: Hydra's launch lines from rank 0 only
        for name in ("hydra", "hydra_plugins"):
            logging.getLogger(name).setLevel(logging.WARNING)
    prog, saved_argv = sys.argv[0], list(sys.argv)
    sys.argv = [prog, *args]
    try:
        with stopped_before_the_job():
            main()
    finally:
        sys.argv = saved_argv
