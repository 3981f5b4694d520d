"""The launcher rules, for every way in (the command line, ``train_model``, tune's candidates):

- several processes started by a launcher (torchrun, the ``deepspeed`` launcher, a SLURM step with
  several tasks) and no engine chosen: DDP, one run whose gradients are averaged over the
  processes (not one copy of the job per process, each writing the same checkpoints), said in
  one log line;
- an engine that runs in one process (its class's ``several_processes`` is False: the local
  engine) started as one of several: refused on every rank before anything is built.

The command line applies them to its config (``looplib.cli.instantiate``: the ``ddp`` option's
file, so config.yaml records it), ``train_model`` to its ``engine=`` argument.
"""
from __future__ import annotations

import logging

from ..process.launcher import launched_rank, launched_world
from ..errors import ConfigError

log = logging.getLogger("looplib")
SAID: list[str] = []


def default_engine(chosen: bool) -> str | None:
    """The ``+engine=`` option the launcher decides when none was ``chosen``: ``ddp`` under a
    launcher with several processes (said in a log line by rank 0), else None (the local engine)."""
    world, who = launched_world()
    if world <= 1 or chosen:
        return None
    if launched_rank() == 0 and not SAID:  # once a process (a sweep checks every job first, then runs each)
        SAID.append(who)
        log.info("%s started %d processes and no engine was chosen: training with +engine=ddp (one run, gradients "
                 "averaged over the processes; choose another with +engine=fsdp or +engine=deepspeed)", who, world)
    return "ddp"


def refuse_one_process(engine_class: type, key: str = "engine") -> None:
    """An engine class that runs in one process only, started by a launcher as one of several:
    ``ConfigError`` (each process would train its own copy of the job)."""
    world, who = launched_world()
    if world <= 1 or getattr(engine_class, "several_processes", False):
        return
    name = "Local" if engine_class.__name__ == "Engine" else engine_class.__name__
    raise ConfigError(key, f"{name} runs in one process, but {who} started {world} of them (each would train its "
                      "own copy of the job)", "use +engine=ddp, +engine=fsdp or +engine=deepspeed (engine=DDP() in "
                      "Python), or start one process")


def engine_for(engine, device: str):
    """``train_model``'s engine under the launcher rules: ``DDP(device)`` for none under a
    launcher with several processes, ``engine`` itself otherwise (refused if it runs in one process)."""
    if engine is None:
        if default_engine(chosen=False) is None:
            return None
        from ..engines import DDP
        return DDP(device=device)
    refuse_one_process(type(engine))
    return engine
