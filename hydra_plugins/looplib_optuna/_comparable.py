"""What makes a study's trials comparable, and the command that runs one again.

A study records the sweep it belongs to (``looplib_sweep``: search space, fixed overrides, metric,
direction) and where its trials ran (``looplib_geometry``: the process count, the launcher and the
global batch). Running the sweep again continues the study only where both are the same: a trial
at global batch 4 is not judged, nor pruned, against trials at 8. Where the user means to mix
them, ``hydra.sweeper.allow_geometry_change=true`` says so.
"""
from __future__ import annotations

import shlex

from omegaconf import DictConfig, OmegaConf

from looplib.errors import ConfigError

BATCH_KEYS = ("batch_size", "accum_steps", "global_batch_size")


def command(overrides: list[str]) -> str:
    """The command line that runs a trial again on its own, on the processes the sweep ran on
    (``torchrun --nproc_per_node 2 -m looplib.train ...`` under torchrun): its global batch."""
    from looplib.process.launcher import relaunch
    return " ".join([relaunch("looplib.train"), *(shlex.quote(o) for o in overrides)])


def geometry(config: DictConfig, searched: list[str]) -> dict:
    """Where this sweep's trials run: the process count, the launcher, and the global batch
    (``batch_size`` x ``accum_steps`` x processes, or ``global_batch_size``; None where the search
    itself varies it or ``batch_size=auto`` chooses it)."""
    from looplib.process.launcher import launched_world, launcher
    world, _ = launched_world()
    batch, accum, fixed = (OmegaConf.select(config, k, default=None, throw_on_resolution_failure=False)
                           for k in BATCH_KEYS)
    accum = 1 if accum is None else accum
    if any(name.lstrip("+~") in BATCH_KEYS for name in searched):
        size = None
    elif fixed is not None:
        size = fixed
    elif isinstance(batch, int) and isinstance(accum, int):
        size = batch * accum * world
    else:
        size = None
    return {"world_size": world, "launcher": launcher(), "global_batch": size}


def described(g: dict) -> str:
    processes = f"{g['world_size']} process{'es' if g['world_size'] != 1 else ''} ({g['launcher']})"
    return processes + (f", global batch {g['global_batch']}" if g.get("global_batch") is not None else "")


def check_geometry(before: dict | None, now: dict, allowed: bool, where: str, key: str) -> None:
    """A study continued on another process count or global batch: refused (``ConfigError``)
    unless ``allowed``. A study that recorded none (an older looplib) is not checked."""
    if not before or allowed or (before.get("world_size"), before.get("global_batch")) == (
            now["world_size"], now["global_batch"]):
        return
    again = f"{before['launcher']} -m looplib.train" if before.get("launcher") not in (None, "python") else \
        "python -m looplib.train"
    raise ConfigError(key, f"{where} ran its trials on {described(before)}, and this sweep would run on "
                      f"{described(now)}: its trials would be judged and pruned against trials of another "
                      "global batch", f"run the sweep as before ({again} ...), give a new directory ({key}=...), "
                      "or mix them knowingly with hydra.sweeper.allow_geometry_change=true")


def check_signature(before: dict | None, now: dict, where: str, key: str) -> None:
    """Another sweep (search space, fixed overrides, metric or direction) into the same study: refused."""
    if before is None or before == now:
        return
    there = [o for o in before["search"] if o not in now["search"]]
    there += [f"sweep.{k}={before[k]}" for k in ("metric", "direction") if before[k] != now[k]]
    here = [o for o in now["search"] if o not in before["search"]]
    here += [f"sweep.{k}={now[k]}" for k in ("metric", "direction") if before[k] != now[k]]
    raise ConfigError(key, f"{where} of another sweep ({' '.join(there) or '-'} there, {' '.join(here) or '-'} here)",
                      f"give a new directory ({key}=...), or the same command")
