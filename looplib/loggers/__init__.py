"""Loggers: where each metrics row goes besides the terminal. ``+logger=`` in the config.

    python -m looplib.train +logger=tensorboard
    python -m looplib.train '+logger=[tensorboard,mlflow,wandb]'      # several at once
    python -m looplib.train +logger.mine._target_=my_pkg.MyLogger      # your own

``metrics.jsonl`` is always written (``JsonLines``); a tracker gets every row it gets (training
and evaluation, same keys, same steps), the resolved config as hyperparameters, the run
directory and the paths of the final artefacts. The loop never calls a logger: ``Telemetry``
does, on rank 0 only (``train.py`` hands the other ranks the null ``Logger``).

A logger has three verbs, all optional (``Logger`` is the null object):

- ``start(run)`` once, before the first row (``run``: a ``Run``);
- ``log(row)`` for every row, a dict with ``step`` and numbers;
- ``finish(status, artefacts)`` once: ``"finished"``, ``"preempted"`` or ``"failed"``, and
  ``{name: path}`` of what the run left (model, adapter, last checkpoint, config, metrics).

Each tracker library is imported only when its option is chosen; a missing one is refused
at build time with the ``pip install`` to run. Trackers keep their run's id in
``<run dir>/trackers.json`` so that ``resume=...`` continues the same tracker run.

One module per concern: ``base`` (``Logger``, ``JsonLines``, the fan-out ``Loggers``, ``Run``),
``tracker`` (what the trackers share), ``tensorboard``, ``mlflow``, ``wandb``; ``build`` (here)
makes them from the config.
"""
from __future__ import annotations

from ..errors import ConfigError
from .base import JsonLines, Logger, Loggers, Run, artefacts, describe, logged_steps
from .mlflow import MLflow
from .tensorboard import TensorBoard
from .tracker import IDS, Tracker, flatten, need_tracker
from .wandb import WandB

__all__ = ["IDS", "JsonLines", "Logger", "Loggers", "MLflow", "Run", "TensorBoard", "Tracker", "WandB", "artefacts",
           "build", "describe", "flatten", "logged_steps", "need_tracker"]


def build(cfg) -> Logger:
    """The loggers the config's ``logger`` node names (``{option: {_target_: ...}}``), as one.
    Each one's keys are checked against its class's signature first (``looplib.schema``)."""
    from omegaconf import OmegaConf

    from ..build import instantiate, locate, resolved
    from ..schema import check_options
    node = cfg.get("logger")
    if node is None:
        return Loggers()
    if "_target_" in node:
        raise ConfigError("logger", "the logger config names a class at its top",
                          "name each logger: +logger.NAME._target_=package.Class (or +logger=tensorboard)")
    built = []
    for name in node:
        options = resolved(node, name) if OmegaConf.is_dict(node[name]) else None
        if not options or "_target_" not in options:
            raise ConfigError(f"logger.{name}", f"logger.{name} names no class",
                              f"+logger.{name}._target_=package.Class, or +logger=tensorboard|mlflow|wandb")
        target = locate(f"logger.{name}", options["_target_"])
        check_options(f"logger.{name}.", target, options, f"from +logger={name}")
        try:
            built.append(instantiate(node, name))
        except ConfigError as err:  # name the setting as the user typed it: logger.<name>...
            key = err.key if err.key.startswith("logger.") else f"logger.{err.key}"
            raise ConfigError(key, err.problem, err.fix) from None
    return Loggers(*built)
