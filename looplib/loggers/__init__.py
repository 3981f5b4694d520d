"""Loggers: where each metrics row goes besides the terminal. ``+logger=`` in the config.

    python -m looplib.train +logger=tensorboard
    python -m looplib.train '+logger=[tensorboard,mlflow,wandb]'      # several at once
    python -m looplib.train +logger.mine._target_=my_pkg.MyLogger      # your own

``metrics.jsonl`` is always written (``JsonLines``); a tracker gets every row it gets (training
and evaluation, same keys, same steps), the resolved config as hyperparameters, the run
directory and the paths of the final artefacts. The loop never calls a logger: ``Telemetry``
does, on rank 0 only (the other ranks get the null ``Logger``).

A logger has three verbs, all optional (``Logger`` is the null object):

- ``start(run)`` once, before the first row (``run``: a ``Run``);
- ``log(row)`` for every row, a dict with ``step`` and numbers;
- ``finish(status, artefacts)`` once: ``"finished"``, ``"preempted"`` or ``"failed"``, and
  ``{name: path}`` of what the run left (model, adapter, last checkpoint, config, metrics).

Each tracker library is imported only when its option is chosen; a missing one is refused
at build time with the ``pip install`` to run. Trackers keep their run's id in
``<run dir>/trackers.json`` so that ``resume=...`` continues the same tracker run.

One module per concern: ``base`` (``Logger``, ``JsonLines``, the fan-out ``Loggers``, ``Run``),
``tracker`` (what the trackers share), ``tensorboard``, ``mlflow``, ``wandb``; the command line
makes them from the config (``looplib.cli.instantiate.build_loggers``).
"""
from __future__ import annotations

from .base import JsonLines, Logger, Loggers, Run, logged_steps
from .mlflow import MLflow
from .tensorboard import TensorBoard
from .tracker import IDS, Tracker, flatten, need_tracker
from .wandb import WandB

__all__ = ["IDS", "JsonLines", "Logger", "Loggers", "MLflow", "Run", "TensorBoard", "Tracker", "WandB", "flatten", "logged_steps", "need_tracker"]
