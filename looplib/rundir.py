"""The run directory: never write into another run's results, never leave a half-written one.

``RunDirGuard`` is a Hydra callback (``hydra.callbacks`` in conf/config.yaml). Hydra calls it
before it creates the run directory, opens its log file there or writes ``.hydra/``, so a
refusal leaves an earlier run's files untouched:

- a directory that already holds a run's results (anything but Hydra's own ``.hydra/`` and
  ``*.log``: checkpoints, metrics.jsonl, model.safetensors, ...) is refused unless the job
  continues that run (``resume=auto``, or ``resume=PATH`` inside it);
- a directory that cannot be made or written (a file in its place, a read-only parent) is
  refused with one line instead of Hydra's traceback.

Every rank checks rank 0's directory, so under torchrun every rank refuses alike (exit 2).
``forget`` removes what a run wrote into a directory that was empty before it, when the run
ends before training (a refused setting, a signal): nothing half-written stays behind.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from . import cli
from .engines import launch
from .errors import EXIT_CONFIG, ConfigError

HYDRA_OWN = (".hydra", "multirun.yaml")  # and *.log: what Hydra writes before a job starts
SEARCH = "hydra_plugins.looplib_optuna.sweeper.OptunaSweeper"  # looplib's Optuna sweeper (hydra/sweeper=optuna)


def results(path: Path) -> list[str]:
    """What ``path`` holds besides Hydra's own files (sorted names; [] for a new directory). A
    subdirectory counts only if it holds something itself (a sweep's job directories hold
    only Hydra's files until their jobs run; under torchrun rank 0's Hydra may have written
    them before another rank looks)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name not in HYDRA_OWN and not p.name.endswith(".log")
                  and not (p.is_dir() and not p.is_symlink() and not results(p)))


def unwritable(path: Path) -> str | None:
    """Why a directory cannot be made or written at ``path``, or None."""
    probe = path
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def check(path: Path, resume: str | None, key: str) -> None:
    """Refuse a run directory that cannot be written or holds another run (``ConfigError``)."""
    why = unwritable(path)
    if why:
        raise ConfigError(key, f"cannot write the run directory {path}: {why}",
                          f"give a writable directory ({key}=...)")
    held = results(path)
    if not held:
        return
    inside = resume and resume != "auto" and Path(resume).resolve().is_relative_to(path.resolve())
    if resume == "auto" or inside:
        return  # this directory's own run, continued
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if resume:
        raise ConfigError(key, f"{path} already holds files ({shown}); resuming {resume} into it "
                          "would mix two runs", f"give a new directory ({key}=...)")
    raise ConfigError(key, f"{path} already holds files ({shown}) that this run would overwrite or mix with its own",
                      f"continue it with resume=auto, or give a new directory ({key}=...)")


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


def refuse(err: ConfigError) -> None:
    if launch.launched_rank() == 0:
        print(f"looplib: error: {err}", file=sys.stderr, flush=True)
    write_exit_status(EXIT_CONFIG)
    sys.exit(EXIT_CONFIG)


def write_exit_status(status: int) -> None:
    """``LOOPLIB_EXIT_FILE``: rank 0 writes its exit status there as its last act. Launchers
    (torchrun) report 1 when a rank exits non-zero, so a job script reads looplib's status here."""
    path = os.environ.get("LOOPLIB_EXIT_FILE")
    if path and launch.launched_rank() == 0:
        tmp = Path(path + ".tmp")
        tmp.write_text(f"{status}\n")
        os.replace(tmp, path)


def fresh_root(config: DictConfig) -> Path | None:
    """Where a new run directory is made when ``hydra.run.dir`` names a new timestamped one
    (``outputs/${now:...}``, the default): ``outputs``. None when it names a fixed directory."""
    pattern = OmegaConf.to_container(config.hydra.run, resolve=False).get("dir")
    if not isinstance(pattern, str) or "${now:" not in pattern:
        return None
    head = pattern.split("${now:", 1)[0].replace("${looplib.rank0_dir:", "")
    return Path(head or ".")


def latest_resumable(root: Path) -> tuple[Path, int] | None:
    """The most recent run directory under ``root`` holding a valid checkpoint, and its step."""
    from .state import is_valid, step_dirs
    runs = {p.parent for depth in ("*/checkpoints", "*/*/checkpoints") for p in root.glob(depth) if p.is_dir()}
    for run in sorted(runs, key=lambda p: (p / "checkpoints").stat().st_mtime, reverse=True):
        for step in step_dirs(run / "checkpoints"):
            if is_valid(step) is None:
                digits = "".join(c for c in step.name if c.isdigit())
                return run, int(digits or 0)
    return None


def check_resume_target(config: DictConfig) -> None:
    """``resume=auto`` with no run directory given would start a new run at step 0: refused,
    naming the most recent run it could continue and the command that does (``ConfigError``)."""
    resume = OmegaConf.select(config, "resume", default=None, throw_on_resolution_failure=False)
    root = fresh_root(config) if resume == "auto" else None
    if root is None:
        return
    task = [o for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    found = latest_resumable(root)
    if found is None:
        raise ConfigError("resume", f"resume=auto continues a run in its directory, but none was given and "
                          f"no run under {root}/ has a checkpoint to continue",
                          "to start a new run leave resume out; to continue a run elsewhere give its directory: "
                          "hydra.run.dir=DIR")
    run, step = found
    command = " ".join(["python -m looplib.train", *continued(run, task), f"hydra.run.dir={run}"])
    raise ConfigError("resume", f"resume=auto continues a run in its directory, but none was given (this run "
                      f"would start afresh at step 0); the most recent run with a checkpoint is {run} (step {step})",
                      f"continue it with: {command}")


def continued(run: Path, task: list[str]) -> list[str]:
    """The overrides that continue ``run``: its own (``.hydra/overrides.yaml``), then those typed
    now (the last of a key wins: a longer max_steps, say), ``resume=auto`` last."""
    import shlex
    try:
        before = [str(o) for o in OmegaConf.load(run / ".hydra" / "overrides.yaml")]
    except (OSError, ValueError, TypeError):
        before = []
    merged: dict[str, str] = {}
    for override in [*before, *task]:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in ("resume", "hydra.run.dir"):
            merged.pop(key, None)  # re-inserted: in the order last given
            merged[key] = override
    return [*map(shlex.quote, merged.values()), "resume=auto"]


class RunDirGuard(Callback):
    """Checks the run (or sweep) directory before Hydra writes anything into it."""

    def _check(self, config: DictConfig, key: str) -> None:
        path = as_rank0(config, key)
        if path is None:
            return
        resume = OmegaConf.select(config, "resume", default=None, throw_on_resolution_failure=False)
        try:
            check(path, None if resume is None else str(resume), key)
        except ConfigError as err:
            refuse(err)

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            check_resume_target(config)
        except ConfigError as err:
            refuse(err)
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if OmegaConf.select(config, "hydra.sweeper._target_") == SEARCH:
            return  # hydra/sweeper=optuna continues its study in its directory, and checks it (looplib.sweep)
        self._check(config, "hydra.sweep.dir")
        if OmegaConf.select(config, "hydra.sweeper._target_", default="").endswith(".BasicSweeper") and \
                OmegaConf.select(config, "hydra.launcher._target_", default="").endswith(".BasicLauncher"):
            from .sweep import check_sweep_jobs  # the jobs run here, one after another
            try:
                check_sweep_jobs(config)  # every job's settings before the first job runs
            except ConfigError as err:
                refuse(err)
        path = as_rank0(config, "hydra.sweep.dir")
        cli.sweep_started(path, fresh=path is not None and not path.exists())

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        cli.job_started()

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        from hydra.core.utils import JobStatus
        cli.job_ended(getattr(job_return, "status", None) == JobStatus.COMPLETED)


def forget(path: Path, fresh: bool) -> None:
    """After a run that ended before training: remove what it wrote. A directory that held
    nothing before the run (``fresh``) is removed whole; otherwise only Hydra's files of this
    attempt would be new, and the directory is left as it is."""
    if not fresh or not path.is_dir():
        return
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        return
    here = Path.cwd().resolve()
    for parent in path.resolve().parents:  # outputs/<date>/ that Hydra made for it, if now empty
        if parent == here or here not in parent.parents:
            break
        try:
            parent.rmdir()
        except OSError:
            break
