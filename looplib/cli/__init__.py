"""The command line: the only part of looplib that imports Hydra or OmegaConf.

    entry        running a ``@hydra.main`` function: arguments normalised, Hydra's refusals as one line
    args         both spellings of a group (``+precision=bf16``, ``model=x``), Hydra's advice, its refusals explained
    main         ``python -m looplib.train``: the config -> parts -> looplib.run.lifecycle.execute
    instantiate  every key checked, group defaults, each group instantiated, trackers built
    resolvers    the ``${looplib.*}`` interpolations of conf/
    guard        ``RunDirGuard``: the run directory checked before Hydra writes into it
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
    """``looplib.cli.entry.run``: a ``@hydra.main`` function run on the normalised command line."""
    from .entry import run as run_entry
    run_entry(main, argv)


def train() -> None:
    """The ``looplib-train`` console script: ``python -m looplib.train``, the same arguments."""
    from .main import main
    run(main)


def __getattr__(name: str):
    """Names that moved away from here: found where they live now, with a warning (``looplib.moved``)."""
    from ..moved import attribute
    return attribute(__name__, name)
