"""``RunDirGuard``, the Hydra callback behind ``python -m looplib.train``'s run directory
(``hydra.callbacks`` in conf/config.yaml): Hydra calls it before it creates the run directory or
opens its log file there, so a refusal leaves an earlier run's files untouched. Hydra itself writes
no ``.hydra/`` (``hydra.output_subdir: null``): the job writes it (``save_hydra_files``, from
``looplib.cli.main``) once this callback holds the directory, on every launcher: a sweep job run
by the joblib or submitit launcher in another process is held there too (``on_job_start``, in the
job's own process) before a byte of it is written. The rules themselves (what a run directory may
hold, removing what a refused run wrote) are Hydra-free, in ``looplib.store.rundir``, which
``train_model`` uses without Hydra.
"""
from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ..process.launcher import launched_rank, launched_world, relaunch
from .resolvers import rank0_dir, resolving_as_rank0
from ..errors import ConfigError
from ..store import lock
from ..atomic import write_atomic
from ..store.rundir import check, latest_resumable
from .entry import refuse as refuse_line
from .record import OVERRIDES, RECORD
from .sweep import SWEEP_RECORD, SWEEPER, forget_sweep


def refuse(err: ConfigError) -> None:
    """One line (said by the rank that refuses: ``looplib.cli.entry.refuse``), the exit status 2,
    before Hydra has written anything."""
    refuse_line(f"looplib: error: {err}")


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
        with resolving_as_rank0():
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
        before = [str(o) for o in OmegaConf.load(run / RECORD / OVERRIDES)]
    except (OSError, ValueError, TypeError):
        before = []
    command = " ".join([relaunch("looplib.train"), *continued([*before, *task]), f"hydra.run.dir={run}"])
    raise ConfigError("resume", f"resume=auto continues a run in its directory, but none was given (this run "
                      f"would start afresh at step 0); the most recent run with a checkpoint is {run} (step {step})",
                      f"continue it with: {command}")


def own_scratch(config: DictConfig, key: str) -> None:
    """Under a launcher, a rank other than 0 writes Hydra's files (``.hydra/``, its log) into a
    scratch directory of its own, also when the command names the run directory itself
    (``hydra.run.dir=DIR``): two ranks writing (or restoring) one ``.hydra/`` would collide, and
    only rank 0 holds the directory (``looplib.store.lock``). Every rank trains into rank 0's
    directory (``engine.ranks.shared_run_dir``)."""
    if launched_rank() == 0 or launched_world()[0] <= 1:
        return
    group, name = key.rsplit(".", 1)
    node = OmegaConf.select(config, group)
    with read_write(node), open_dict(node):
        node[name] = rank0_dir("")  # this rank's scratch directory


def continued(overrides: list[str]) -> list[str]:
    """The overrides of a command that continues a run, shell-quoted: ``overrides`` with the last
    value of each key kept (in the order last given), no run directory, ``resume=auto`` last."""
    import shlex
    merged: dict[str, str] = {}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in ("resume", "hydra.run.dir"):
            merged.pop(key, None)
            merged[key] = override
    return [*map(shlex.quote, merged.values()), "resume=auto"]


def snapshot(path: Path) -> dict[str, bytes | int]:
    """What a job is about to rewrite in an existing run directory: the bytes of ``.hydra/*`` and
    the length of each log file (appended to), so that a refused command can put them back."""
    held: dict[str, bytes | int] = {}
    if path.is_dir():
        for f in sorted((path / RECORD).glob("*")) if (path / RECORD).is_dir() else ():
            if f.is_file():
                held[str(f.relative_to(path))] = f.read_bytes()
        for f in path.glob("*.log"):
            held[f.name] = f.stat().st_size
    return held


def restore(path: Path, held: dict[str, bytes | int]) -> None:
    """Undo what a refused command wrote into an existing run directory (``snapshot``'s files
    byte for byte, logs cut back to their length; files it added removed)."""
    import os
    record = path / RECORD
    for f in sorted(record.glob("*")) if record.is_dir() else ():
        if str(f.relative_to(path)) not in held and f.is_file():
            f.unlink()
    for f in path.glob("*.log"):
        if f.name not in held:
            f.unlink()
    for name, was in held.items():
        f = path / name
        if isinstance(was, int):
            if f.exists() and f.stat().st_size != was:
                os.truncate(f, was)
        elif not f.exists() or f.read_bytes() != was:
            f.parent.mkdir(exist_ok=True)
            write_atomic(f, was)
    if record.is_dir() and not any(record.iterdir()) and not any(k.startswith(f"{RECORD}/") for k in held):
        record.rmdir()


def save_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """A job's ``.hydra/`` (config.yaml: its config; hydra.yaml: Hydra's node; overrides.yaml: the
    command line's overrides), written by the job in its held directory, as Hydra writes them."""
    from hydra.core.hydra_config import HydraConfig
    hydra = HydraConfig.instance().cfg
    out = Path(run_dir) / RECORD
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(hydra, out / "hydra.yaml")
    OmegaConf.save(hydra.hydra.overrides.task, out / OVERRIDES)


class RunDirGuard(Callback):
    """Checks the run (or sweep) directory before Hydra writes anything into it, and holds it
    (``looplib.store.lock``, rank 0) until the run ends; holds a sweep job's directory as the job
    starts, before the job writes its ``.hydra/``."""

    def __init__(self):
        self.held: Path | None = None
        self.job_held: Path | None = None  # a sweep job's directory, held from before the job writes
        self.sweep_dir: Path | None = None  # this command's sweep directory (removed when the sweep is refused)

    def refuse(self, err: ConfigError) -> None:
        if self.sweep_dir is not None:
            forget_sweep(self.sweep_dir)
        refuse(err)

    def _check(self, config: DictConfig, key: str) -> None:
        path = as_rank0(config, key)
        if path is None:
            return
        resume = OmegaConf.select(config, "resume", default=None, throw_on_resolution_failure=False)
        try:
            check(path, None if resume is None else str(resume), key, SWEEP_RECORD if key == "hydra.sweep.dir" else ())
            if launched_rank() == 0:  # another rank resolves rank 0's ${now:...} a second later
                fresh = not path.exists()
                made(path, key)
                lock.hold(path, key, made=fresh)  # a second run on it is refused here, before Hydra writes a byte
                self.held = path
        except ConfigError as err:
            refuse(err)

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            check_resume_target(config)
        except ConfigError as err:
            refuse(err)
        self._check(config, "hydra.run.dir")
        own_scratch(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if OmegaConf.select(config, "hydra.sweeper._target_") == SWEEPER:
            return  # hydra/sweeper=optuna continues its study in its directory, and checks it (looplib.cli.sweep)
        self._check(config, "hydra.sweep.dir")
        self.sweep_dir = self.held  # a sweep refused from here on leaves no directory behind (if it made it)
        if OmegaConf.select(config, "hydra.sweeper._target_", default="").endswith(".BasicSweeper") and \
                OmegaConf.select(config, "hydra.launcher._target_", default="").endswith(".BasicLauncher"):
            from .sweep import check_sweep_jobs  # the jobs run here, one after another
            try:
                check_sweep_jobs(config)  # every job's settings before the first job runs
            except ConfigError as err:
                self.refuse(err)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        """A sweep job's directory, held (rank 0) in the job's own process (any launcher) before the
        job writes into it: a job pointed into a live run's directory is refused here, in one line
        naming the job's directory, and the live run's files stay as they were."""
        from hydra.core.hydra_config import HydraConfig
        hydra = HydraConfig.get()
        if hydra.mode != RunMode.MULTIRUN or launched_rank() != 0 or self.job_held is not None:
            return
        path = Path(str(hydra.runtime.output_dir)).absolute()
        try:
            lock.hold(path, "hydra.sweep.dir", f"the directory of job {hydra.job.num} of the sweep, {path},")
        except ConfigError as err:
            self.refuse(err)
        self.job_held = path

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        if self.job_held is not None:
            lock.release(self.job_held)  # the sweep job is over
            self.job_held = None
        if self.held is not None and OmegaConf.select(config, "hydra.mode", default=None) != RunMode.MULTIRUN:
            lock.release(self.held)  # the run is over (a sweep's directory is held until the process ends)
            self.held = None
