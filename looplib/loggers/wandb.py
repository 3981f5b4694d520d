"""A Weights & Biases run (``+logger=wandb``)."""
from __future__ import annotations

import os
from typing import Literal

from .base import Run
from .tracker import Tracker, need_tracker


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
