"""``RunDirGuard``, the Hydra callback behind ``python -m looplib.train``'s run directory
(``hydra.callbacks`` in conf/config.yaml): Hydra calls it before it creates the run directory,
opens its log file there or writes ``.hydra/``, so a refusal leaves an earlier run's files
untouched. The rules themselves (what a run directory may hold, removing what a refused run
wrote) are Hydra-free, in ``looplib.run.rundir``, which ``train_model`` uses without Hydra.
It also tells ``looplib.cli.entry`` when a job starts and ends (from then on an exception is
the job's own, reported by Hydra as always).
"""
from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ..engines import launch
from ..errors import EXIT_CONFIG, ConfigError
from ..run.rundir import check, continued, latest_resumable, results, snapshot, write_exit_status
from .entry import BOUNDARY
from .sweep import SWEEPER


def refuse(err: ConfigError) -> None:
    """One line (rank 0), the exit status 2, before Hydra has written anything."""
    if launch.launched_rank() == 0:
        print(f"looplib: error: {err}", file=sys.stderr, flush=True)
    write_exit_status(EXIT_CONFIG)
    sys.exit(EXIT_CONFIG)


def made(path: Path, key: str) -> None:
    """Make the directory Hydra is about to make (a refused run removes it again), so that one
    that cannot be made (``/proc/x``, a path under a file) is a refusal, not Hydra's traceback."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(key, f"cannot make the run directory {path}: {err.strerror or err}",
                          f"give a directory that can be made and written ({key}=...)") from None


def as_rank0(config: DictConfig, key: str) -> Path | None:
    """The directory ``key`` names for rank 0 (every rank resolves the same one), or None
    where it does not resolve here (Hydra then reports its own error)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        HydraConfig.instance().set_config(config)  # for ${hydra:...} in the path
        with launch.resolving_as_rank0():
            return Path(str(OmegaConf.select(config, key))).absolute()
    except Exception:  # noqa: BLE001
        return None


def fresh_root(config: DictConfig) -> Path | None:
    """Where a new run directory is made when ``hydra.run.dir`` names a new timestamped one
    (``outputs/${now:...}``, the default): ``outputs``. None when it names a fixed directory."""
    pattern = OmegaConf.to_container(config.hydra.run, resolve=False).get("dir")
    if not isinstance(pattern, str) or "${now:" not in pattern:
        return None
    head = pattern.split("${now:", 1)[0].replace("${looplib.rank0_dir:", "")
    return Path(head or ".")


def check_resume_target(config: DictConfig) -> None:
    """``resume=auto`` with no run directory given would start a new run at step 0: refused,
    naming the most recent run it could continue and the command that does (``ConfigError``)."""
    resume = OmegaConf.select(config, "resume", default=None, throw_on_resolution_failure=False)
    root = fresh_root(config) if resume == "auto" else None
    if root is None:
        return
    task = [o for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    typed = [o.split("=", 1)[1] for o in task if o.lstrip("+~").startswith("max_steps=")]
    try:
        goal = int(typed[-1]) if typed else None  # a longer run asked for: a finished one may go on
    except ValueError:
        goal = None
    found = latest_resumable(root, goal)
    if found is None:
        raise ConfigError("resume", f"resume=auto continues a run in its directory, but none was given and "
                          f"no run under {root}/ has a checkpoint it can continue from (a finished run has none)",
                          "to start a new run leave resume out; to continue a run elsewhere give its directory: "
                          "hydra.run.dir=DIR")
    run, step = found
    try:  # that run's own overrides, then those typed now
        before = [str(o) for o in OmegaConf.load(run / ".hydra" / "overrides.yaml")]
    except (OSError, ValueError, TypeError):
        before = []
    command = " ".join([launch.relaunch("looplib.train"), *continued([*before, *task]), f"hydra.run.dir={run}"])
    raise ConfigError("resume", f"resume=auto continues a run in its directory, but none was given (this run "
                      f"would start afresh at step 0); the most recent run with a checkpoint is {run} (step {step})",
                      f"continue it with: {command}")


class RunDirGuard(Callback):
    """Checks the run (or sweep) directory before Hydra writes anything into it."""

    def _check(self, config: DictConfig, key: str) -> None:
        path = as_rank0(config, key)
        if path is None:
            return
        resume = OmegaConf.select(config, "resume", default=None, throw_on_resolution_failure=False)
        try:
            check(path, None if resume is None else str(resume), key)
            if launch.launched_rank() == 0:  # another rank resolves rank 0's ${now:...} a second later
                made(path, key)
        except ConfigError as err:
            refuse(err)

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            check_resume_target(config)
        except ConfigError as err:
            refuse(err)
        self._check(config, "hydra.run.dir")
        path = as_rank0(config, "hydra.run.dir")
        if path is not None and results(path):  # an existing run, continued: what Hydra rewrites, kept
            BOUNDARY.held = (path, snapshot(path))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if OmegaConf.select(config, "hydra.sweeper._target_") == SWEEPER:
            return  # hydra/sweeper=optuna continues its study in its directory, and checks it (looplib.cli.sweep)
        path = as_rank0(config, "hydra.sweep.dir")  # a sweep refused from here on leaves no directory behind
        BOUNDARY.sweep_dir, BOUNDARY.sweep_fresh = path, path is not None and not path.exists()
        self._check(config, "hydra.sweep.dir")
        if OmegaConf.select(config, "hydra.sweeper._target_", default="").endswith(".BasicSweeper") and \
                OmegaConf.select(config, "hydra.launcher._target_", default="").endswith(".BasicLauncher"):
            from .sweep import check_sweep_jobs  # the jobs run here, one after another
            try:
                check_sweep_jobs(config)  # every job's settings before the first job runs
            except ConfigError as err:
                refuse(err)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        BOUNDARY.in_job = True

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        BOUNDARY.in_job = False  # the next job's arguments are the command line's again
