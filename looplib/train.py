"""Hydra entry point: ``python -m looplib.train [+group=option ...] [key=value ...]``.

Only the mapping from the composed config to looplib's one assembly (``looplib.assemble``):
check every key, instantiate each config group into its strategy object (cheap checks first,
so bad input fails before a tokenizer is trained or a model is built), then build and run
exactly what ``train_model`` builds and runs from Python; every way the run ends becomes one
line and an exit status.
"""
from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from . import assemble, loggers, rundir, sweep
from .assemble import Job, Parts, Record
from .build import STRATEGIES, check_config, instantiate, origin
from .engines.launch import EXIT_LOST_RANK, launched_rank, launched_world, lost_rank_line
from .errors import EXIT_CONFIG, ConfigError
from .checkpoints import EXIT_IO, EXIT_NUMERIC, NumericError, SaveError
from .resolvers import register_resolvers
from .signals import Interrupted, Signals
from .train_state import TrainState

log = logging.getLogger("looplib")
register_resolvers()  # ${looplib.rank0_dir:...}: one run directory per run under torchrun

def build_job(cfg: DictConfig) -> Job:
    """Checks first (cheap), then the expensive pieces (data, model), then the assembly."""
    settings = check_config(cfg)  # every key, top level and in every group: type, range, existence
    # +logger= choices (keys checked, libraries imported: a missing one is a ConfigError), and in a pruned
    # search the trial's reporter (looplib.sweep)
    trackers = loggers.Loggers(loggers.build(cfg), *sweep.reporting(cfg))
    built = {group: instantiate(cfg, group) for group in STRATEGIES}
    try:
        built["engine"] = assemble.check(settings, built["engine"], built["precision"], built["optim"],
                                         built["evaluation"])
        torch.manual_seed(settings.seed)  # before the data and the model: their initialisation is seeded
        data = instantiate(cfg, "data")
        parts = Parts(model=instantiate(cfg, "model"), data=data, objective=built.pop("loss"), logger=trackers, **built)
        return assemble.build(parts, settings, record(cfg))
    except BaseException:
        built["precision"].close()  # what its setup changed in the process (a sweep's next job runs here)
        raise


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
    return Record(OmegaConf.to_container(cfg, resolve=True), lambda config: OmegaConf.to_yaml(OmegaConf.create(config)),
                  name, group, continue_command().replace("{", "{{").replace("}", "}}") + "{run_dir}", origins)


def continue_command() -> str:
    """The command that continues this run, ready to paste but for its directory (appended): the
    job's own overrides, then resume=auto and hydra.run.dir=."""
    task = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    world, who = launched_world()
    start = ["python", "-m", "looplib.train"] if world <= 1 else [who, "...", "-m", "looplib.train"]
    return " ".join([*start, *rundir.continued(task), "hydra.run.dir="])


def run(job: Job, run_dir: Path, signals: Signals | None = None) -> TrainState:
    return assemble.run(job, run_dir, signals).state


def say(line: str) -> None:
    """One line on stderr, from one rank (every rank finds the same error)."""
    if launched_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def execute(cfg: DictConfig, run_dir: Path, signals: Signals) -> int:
    """Build and run the job; every way it can end becomes one line and an exit status."""
    fresh = False
    try:
        fresh = not rundir.results(run_dir)  # held nothing before this run (RunDirGuard refused otherwise)
        job = build_job(cfg)
        shared = job.engine.shared_run_dir(run_dir)  # rank 0's: one directory per run, not per rank
        if shared != run_dir:
            rundir.forget(run_dir, fresh=True)  # this rank's scratch directory
            run_dir, fresh = shared, fresh and not rundir.results(shared)
        state = run(job, run_dir, signals)
    except ConfigError as err:  # found before training: nothing of this run stays behind
        signals.finish()
        say(f"looplib: error: {err}")
        rundir.forget(run_dir, fresh and not signals.training)
        return EXIT_CONFIG
    except NumericError as err:
        signals.finish()
        say(f"looplib: stopped: {err}")
        return EXIT_NUMERIC
    except SaveError as err:
        signals.finish()
        say(f"looplib: error: {err}; the last complete checkpoint stays (resume=auto continues from it)")
        return EXIT_IO
    except Exception as err:  # noqa: BLE001 - a collective that failed because another rank is gone
        # first of all: torchrun's SIGTERM to the survivors follows, and may arrive while the lost
        # rank is looked for; from here it changes nothing (the run has ended either way)
        signals.finish()
        line = lost_rank_line(err)
        if line is None:
            raise
        if line:
            print(line, file=sys.stderr, flush=True)
        return EXIT_LOST_RANK
    except Interrupted as sig:
        signals.finish()
        if signals.training:  # a second Ctrl-C while training
            say(f"looplib: stopped at once ({sig}); the last complete checkpoint stays. Continue with: "
                f"{continue_command()}{shlex.quote(str(run_dir))}")
        else:
            say(f"looplib: stopped ({sig}) before training started; nothing was saved")
            rundir.forget(run_dir, fresh)
        return sig.status
    status = signals.status if state.preempted else 0
    signals.finish()
    job.engine.close()  # a collective (DDP, DeepSpeed): only when every rank got here
    return status


@hydra.main(version_base="1.3", config_path="pkg://looplib.conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    signals = Signals().__enter__()  # not restored: a late signal (a launcher's) must not kill the exit
    status = sweep.job(lambda: execute(cfg, run_dir, signals))  # in a sweep, a crash is a failed trial
    signals.finish()                 # from here on a signal changes nothing
    rundir.write_exit_status(status)
    return sweep.outcome(cfg, run_dir, status, signals)  # the objective for a sweeper; exits on failure


if __name__ == "__main__":
    from .cli import run as run_cli
    run_cli(main)  # both spellings of a group; Hydra's refusals as one line (deepspeed's --local_rank dropped)
