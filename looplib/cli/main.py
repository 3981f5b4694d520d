"""Hydra entry point: ``python -m looplib.train [+group=option ...] [key=value ...]``.

Only the mapping from the composed config to looplib's typed job (``job_spec``: every key
checked, each cheap config group instantiated into its strategy object, the data and the model
left as recipes, so bad input fails before a tokenizer is trained or a model is built), run by a
``looplib.run.session.Session`` exactly as ``train_model`` runs one from Python; the ending it
raises becomes its line and the exit status.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ..process import this
from ..process.launcher import relaunch
from ..data import identity
from ..errors import ConfigError, Interrupted, NothingToDo, PeerRefused, RunEnded
from ..groups import strategies
from ..loggers import Loggers
from ..store import rundir
from ..run.assembly import Job, JobSpec, Parts, Recipe, Record
from ..run.session import Session, assemble
from ..store.lock import DirectoryHeld
from ..run.settings import NOT_ARGUMENTS
from ..run.signals import Signals
from . import sweep
from .guard import continued, restore, save_hydra_files, snapshot
from .instantiate import build_loggers, check_config, instantiate, locate, origin


class GroupRecipe(Recipe):
    """A config group instantiated only when the session builds it (the data and the model: after
    every cheap check has passed, seeded)."""

    def __init__(self, cfg: DictConfig, name: str):
        self.cfg, self.name = cfg, name

    def build(self, expected=None):
        """The group's object; ``expected`` (a resume's ``identity.Expected``) to a class that takes it."""
        target = self.cfg[self.name].get("_target_")
        takes = expected is not None and target and identity.takes_expected(locate(self.name, target))
        runtime = {"expected": expected} if takes else {}
        return instantiate(self.cfg, self.name, **runtime)


def job_spec(cfg: DictConfig) -> JobSpec:
    """The typed job of a composed config: every key checked (type, range, existence), the cheap
    parts built (a missing package is a ``ConfigError`` here), the data and the model left as
    recipes the session builds after the checks."""
    settings = check_config(cfg)  # every key, top level and in every group: type, range, existence
    # +logger= choices, and in a pruned search the trial's reporter (looplib.cli.sweep)
    trackers = Loggers(build_loggers(cfg), *sweep.reporting(cfg))
    # a group absent from the config (one with no default file) is its null object (Parts.fill)
    built = {row.part: instantiate(cfg, row.name) for row in strategies() if cfg.get(row.name) is not None}
    parts = Parts.of(data=GroupRecipe(cfg, "data"), model=GroupRecipe(cfg, "model"), logger=trackers, **built)
    init = cfg.model.get("init_from")  # a finished run's weights, only them (looplib.store.init_from)
    return JobSpec(parts, settings, record(cfg), init_from=str(init) if init else None)


def build_job(cfg: DictConfig) -> Job:
    """The job the command line would train, built and not trained (tests, the profiler)."""
    return assemble(job_spec(cfg))


def record(cfg: DictConfig) -> Record:
    """The config as the run saves it, and the names trackers give the job (a sweep's jobs share
    ``group``: their multirun directory)."""
    name, group = "", None
    if HydraConfig.initialized():
        from hydra.types import RunMode
        hc = HydraConfig.get()
        overrides = " ".join(hc.overrides.task)
        if hc.mode == RunMode.MULTIRUN:
            group, name = str(hc.sweep.dir), f"{hc.job.num}: {overrides}" if overrides else str(hc.job.num)
        else:
            name = overrides
    origins = {}
    for group_name in ("loader", "optim", "schedule"):
        target = cfg[group_name].get("_target_") if group_name in cfg else None
        origins[group_name] = f" ({target}, {origin(group_name, target)})" if target else ""
    return Record(used(cfg), name, group,
                  continue_command().replace("{", "{{").replace("}", "}}") + "{run_dir}", origins)


def used(cfg: DictConfig) -> dict:
    """The config resolved, less a top-level ``lr``/``weight_decay`` that nothing interpolates (an
    ``optim.lr=0.01`` given directly leaves conf/config.yaml's ``lr`` unused: config.yaml records
    what ran, as a Python run's does)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    raw = OmegaConf.to_container(cfg, resolve=False)
    text = str({k: v for k, v in raw.items() if k not in NOT_ARGUMENTS})  # every other value, nested ones too
    return {k: v for k, v in config.items() if k not in NOT_ARGUMENTS or re.search(r"\$\{[^}]*\b%s\b" % k, text)}


def continue_command() -> str:
    """The command that continues this run, ready to paste but for its directory (appended): the
    job's own overrides, then resume=auto and hydra.run.dir=."""
    task = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return " ".join([relaunch("looplib.train"), *continued(task), "hydra.run.dir="])  # its launcher too


def run(cfg: DictConfig, run_dir: Path, signals: Signals, held: dict | None = None) -> int:
    """The job, through the front door; every way it can end becomes one line and an exit status.
    ``held``: what an existing run's directory held before this job wrote into it (``guard.snapshot``)."""
    fresh = held is None  # held nothing before this run (RunDirGuard refused otherwise)
    try:
        with Session(run_dir, signals, fresh=fresh, key="hydra.sweep.dir" if sweep.in_sweep() else "hydra.run.dir") \
                as session:
            session.run(job_spec(cfg))
    except RunEnded as end:
        if isinstance(end, (ConfigError, Interrupted, NothingToDo, PeerRefused)) and not signals.training \
                and held is not None and not isinstance(end, DirectoryHeld):
            restore(run_dir, held)  # refused: the run it named is byte for byte as it was
        if end.line:
            print(end.line, file=sys.stderr, flush=True)
        if isinstance(end, ConfigError):  # the refusing rank, whichever it is (rank 0 may be stopped before it writes)
            rundir.write_exit_status(end.status, every_rank=True)
            this().board.heard()  # the other ranks know why before the launcher stops them
        return end.status
    return 0


@hydra.main(version_base="1.3", config_path="pkg://looplib.conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    signals = Signals().__enter__()  # not restored: a late signal (a launcher's) must not kill the exit
    held = snapshot(run_dir) if rundir.results(run_dir) else None  # a run continued: what is rewritten, kept
    save_hydra_files(run_dir, cfg)  # the directory is held (RunDirGuard): the job's .hydra/, as Hydra would write it
    sweep.no_sample_unless_asked(cfg)
    status = sweep.job(lambda: run(cfg, run_dir, signals, held))  # in a sweep, a crash is a failed trial
    signals.finish()                 # from here on a signal changes nothing
    rundir.write_exit_status(status)
    return sweep.outcome(cfg, run_dir, status, signals)  # the objective for a sweeper; exits on failure
