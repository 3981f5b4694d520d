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
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError, need
from .schema import Positive

log = logging.getLogger("looplib")
IDS = "trackers.json"  # in the run directory: each tracker's run id, for resumed runs


@dataclass
class Run:
    """What a logger learns when the run starts."""
    dir: Path                        # the run directory
    config: dict                     # the resolved config, plain dicts and lists
    name: str                        # a short name: the job's overrides, or the run directory's name
    group: str | None = None         # the sweep (multirun directory) this job belongs to; None: a single run
    resumed_from: int = 0            # the checkpoint step a resumed run continues after (0: a fresh run)
    logged: dict[str, int] = field(default_factory=dict)  # per key: the last step an earlier attempt wrote


class Logger:
    """The null object: keeps nothing. Subclass it and override the verbs you need."""

    def start(self, run: Run) -> None:
        pass

    def log(self, row: dict) -> None:
        pass

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        pass


class JsonLines(Logger):
    """``metrics.jsonl``: one JSON object per row, appended, line-buffered. Always on."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = open(self.path, "a", buffering=1)

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")

    def finish(self, status: str = "finished", artefacts: dict[str, str] | None = None) -> None:
        self.file.close()


class Loggers(Logger):
    """Several loggers as one. A logger that fails to finish does not stop the others."""

    def __init__(self, *loggers: Logger):
        self.loggers = loggers

    def start(self, run: Run) -> None:
        for logger in self.loggers:
            logger.start(run)

    def log(self, row: dict) -> None:
        for logger in self.loggers:
            logger.log(row)

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        for logger in self.loggers:
            try:
                logger.finish(status, artefacts)
            except Exception as err:  # noqa: BLE001 - the run's own outcome matters more
                log.warning("logger %s did not finish cleanly: %s", type(logger).__name__, err)


class Tracker(Logger):
    """What the bundled trackers share: the run id kept in the run directory, and on resume
    the rows an earlier attempt already sent left out (a tracker cannot take rows back). A
    tracker first chosen when a run is resumed gets the rows before the checkpoint first."""
    name = "tracker"  # the key in trackers.json

    def start(self, run: Run) -> None:
        self.run = run
        self.continued = self.stored_id() is not None
        self.skip = dict(run.logged) if self.continued else {}

    def catch_up(self) -> None:
        """A resumed run this tracker did not see start: send it metrics.jsonl's rows so far."""
        metrics = self.run.dir / "metrics.jsonl"
        if self.run.resumed_from and not self.continued and metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.strip():
                    self.log(json.loads(line))

    def stored_id(self) -> str | None:
        """This tracker's run id from an earlier attempt of this run (resumed runs only)."""
        path = self.run.dir / IDS
        if not self.run.resumed_from or not path.exists():
            return None
        return json.loads(path.read_text()).get(self.name)

    def store_id(self, run_id: str) -> None:
        path = self.run.dir / IDS
        ids = json.loads(path.read_text()) if path.exists() else {}
        ids[self.name] = run_id
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(ids, indent=1) + "\n")
        os.replace(tmp, path)

    def fresh(self, row: dict) -> dict:
        """The row's numbers the tracker does not have yet (``step`` left out)."""
        step = row["step"]
        return {k: v for k, v in row.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
                and step > self.skip.get(k, 0)}


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``; lists and None as text."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


def need_tracker(module: str, extra: str, option: str):
    """Import a tracker library, or refuse with the one line that says what to install."""
    return need(module, extra, f"logger.{option}", f"+logger={option}", f"leave out +logger={option}")


class TensorBoard(Tracker):
    """Event files in the run directory (``tensorboard --logdir outputs``; a sweep's jobs are
    folders of its multirun directory: ``tensorboard --logdir multirun/DATE/TIME``). The
    config is in the HParams tab and as text; artefact paths as text. On resume the event
    files are purged from the checkpoint's next step on, so the resumed rows replace them."""
    name = "tensorboard"

    def __init__(self, flush_secs: Positive[int] = 30):
        self.flush_secs = flush_secs
        need_tracker("tensorboard", "tensorboard", "tensorboard")
        self.writer = None

    def start(self, run: Run) -> None:
        super().start(run)
        self.continued = any(run.dir.glob("events.out.tfevents.*"))
        self.skip = {}  # purge_step replaces what the earlier attempt wrote past the checkpoint
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        self.writer = SummaryWriter(str(run.dir), flush_secs=self.flush_secs,
                                    purge_step=run.resumed_from + 1 if run.resumed_from else None)
        if not self.continued:
            params = flatten(run.config)
            for summary in hparams(params, {"loss": 0.0, "eval_loss": 0.0}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=1) + "\n```", 0)
            self.writer.add_text("run_dir", str(run.dir), 0)
        self.catch_up()

    def log(self, row: dict) -> None:
        for key, value in self.fresh(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        if self.writer is None:
            return
        if artefacts:
            self.writer.add_text("artefacts", "\n".join(f"- {k}: `{v}`" for k, v in artefacts.items()))
        self.writer.add_text("status", status)
        self.writer.close()


class MLflow(Tracker):
    """An MLflow run. Store: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a local SQLite
    store ``mlflow.db`` in the run directory's parent (a sweep's: its multirun directory; view it
    with ``mlflow ui --backend-store-uri sqlite:///<parent>/mlflow.db``). MLflow 3 refuses its
    old ``./mlruns`` file store unless ``MLFLOW_ALLOW_FILE_STORE=true``, hence SQLite, MLflow's
    own default now. Experiment: ``experiment``, else
    ``MLFLOW_EXPERIMENT_NAME``, else the sweep directory for a sweep's jobs and ``looplib``
    for single runs. Params: the resolved config, flattened (``optim.lr``); tags: the run
    directory and the artefact paths."""
    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None):
        self.tracking_uri, self.experiment = tracking_uri, experiment
        need_tracker("mlflow", "mlflow", "mlflow")
        self.client = self.run_id = None

    def start(self, run: Run) -> None:
        super().start(run)
        from mlflow.tracking import MlflowClient
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        local = None if uri else run.dir.parent.resolve()
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{local / 'mlflow.db'}")
        self.run_id = self.stored_id()
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            known = self.client.get_run(self.run_id).data.params
        else:
            name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.group or "looplib"
            found = self.client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else self.client.create_experiment(
                name, artifact_location=(local / "mlartifacts").as_uri() if local else None)
            self.run_id = self.client.create_run(experiment_id, run_name=run.name[:250],
                                                 tags={"looplib.run_dir": str(run.dir)}).info.run_id
            self.store_id(self.run_id)
            known = {}
        from mlflow.entities import Param
        params = {k: str(v)[:6000] for k, v in flatten(run.config).items()}
        changed = {f"looplib.resume_changed.{k}": v for k, v in params.items() if k in known and known[k] != v}
        params = [Param(k, v) for k, v in params.items() if k not in known]  # params cannot change
        for i in range(0, len(params), 100):  # the store takes at most 100 per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        for key, value in changed.items():
            self.client.set_tag(self.run_id, key, value)
        self.catch_up()

    def log(self, row: dict) -> None:
        import time

        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, row["step"]) for k, v in self.fresh(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        if self.client is None:
            return
        for name, path in artefacts.items():
            self.client.set_tag(self.run_id, f"looplib.{name}", path)
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "preempted": "KILLED"}.get(status, "FAILED"))


class WandB(Tracker):
    """A Weights & Biases run, written under ``<run dir>/wandb/``. Offline unless ``mode`` or
    ``WANDB_MODE`` says otherwise (``wandb sync <run dir>/wandb/offline-run-*`` uploads it
    later). Project: ``project``, else ``WANDB_PROJECT``, else ``looplib``; a sweep's jobs share
    a group named after the sweep directory. Config: the resolved config; summary: the run
    directory and the artefact paths."""
    name = "wandb"

    def __init__(self, project: str | None = None, mode: Literal["offline", "online", "disabled"] | None = None,
                 entity: str | None = None):
        self.project, self.mode, self.entity = project, mode, entity
        need_tracker("wandb", "wandb", "wandb")
        self.wandb_run = None

    def start(self, run: Run) -> None:
        super().start(run)
        import wandb
        run_id = self.stored_id()
        self.wandb_run = wandb.init(
            project=self.project or os.environ.get("WANDB_PROJECT") or "looplib", entity=self.entity,
            mode=self.mode or os.environ.get("WANDB_MODE") or "offline", dir=str(run.dir), group=run.group,
            name=run.name[:128], config=run.config, id=run_id, resume="allow" if run_id else None,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        if run_id is None:
            self.store_id(self.wandb_run.id)
        self.wandb_run.summary["run_dir"] = str(run.dir)
        self.catch_up()

    def log(self, row: dict) -> None:
        values = self.fresh(row)
        if values:
            self.wandb_run.log(values, step=row["step"])

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        if self.wandb_run is None:
            return
        for name, path in artefacts.items():
            self.wandb_run.summary[name] = path
        self.wandb_run.finish(exit_code={"finished": 0, "preempted": 0}.get(status, 1))


# ---- building them from the config (train.py) ----

def build(cfg) -> Logger:
    """The loggers the config's ``logger`` node names (``{option: {_target_: ...}}``), as one.
    Each one's keys are checked against its class's signature first (``looplib.schema``)."""
    from omegaconf import OmegaConf

    from .build import instantiate, locate, resolved
    from .schema import check_options
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


def logged_steps(metrics: Path) -> dict[str, int]:
    """Per key, the last step at which ``metrics.jsonl`` holds it: what an earlier attempt of
    this run sent its trackers (read before a resume cuts the rows past the checkpoint)."""
    last: dict[str, int] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                for key in row:
                    last[key] = max(last.get(key, 0), row.get("step", 0))
    return last


def describe(cfg, run_dir: Path, resumed_from: int, logged: dict[str, int]) -> Run:
    """The ``Run`` a logger starts with, from the config and Hydra's runtime (a sweep's jobs
    share ``group``: their multirun directory)."""
    from omegaconf import OmegaConf
    config = OmegaConf.to_container(cfg, resolve=True)
    name, group = run_dir.name, None
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        hc = HydraConfig.get()
        overrides = " ".join(hc.overrides.task)
        if hc.mode == RunMode.MULTIRUN:
            group = str(hc.sweep.dir)
            name = f"{hc.job.num}: {overrides}" if overrides else str(hc.job.num)
        elif overrides:
            name = overrides
    except ValueError:  # not under Hydra
        pass
    return Run(run_dir, config, name, group, resumed_from, logged if resumed_from else {})


def artefacts(run_dir: Path) -> dict[str, str]:
    """What the run left for people to use, by name, where it exists."""
    out = {}
    for name, rel in (("model", "model.safetensors"), ("adapter", "adapter"), ("hf", "hf"),
                      ("config", "config.yaml"), ("metrics", "metrics.jsonl")):
        if (run_dir / rel).exists():
            out[name] = str(run_dir / rel)
    from .checkpoint_files import step_dirs
    newest = step_dirs(run_dir / "checkpoints")  # newest first; the run just wrote it (no re-hash)
    if newest:
        out["checkpoint"] = str(newest[0])
    return out
