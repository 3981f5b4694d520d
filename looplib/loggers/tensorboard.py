"""TensorBoard event files in the run directory (``+logger=tensorboard``)."""
from __future__ import annotations

import json

from ..schema import Positive
from .base import Run
from .tracker import Tracker, flatten, need_tracker


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
