"""A logger that sends its own process SIGTERM when the metrics row of ``step`` is logged: a run
preempted mid-run, exactly, from Python (``train_model(..., logger=SignalAt(4))``) or the command
line (``+logger.stop._target_=signal_at.SignalAt +logger.stop.step=4``, tests/ on PYTHONPATH)."""
import os
import signal

from looplib.loggers import Logger


class SignalAt(Logger):
    def __init__(self, step: int = 1):
        self.step = step

    def log(self, row):
        if row.get("step") == self.step and "loss" in row:
            os.kill(os.getpid(), signal.SIGTERM)


class KillAfterLastCheckpoint(Logger):
    """SIGKILL to its own process when the run's closing row (its checkpoints' costs) is logged:
    after the final checkpoint is complete, before the weights are exported (issue 43). Only where
    ``KILL_AFTER_LAST_CHECKPOINT=1``: a resume keeps the logger (a changed one is refused) and lives."""

    def log(self, row):
        if "checkpoints" in row and os.environ.get("KILL_AFTER_LAST_CHECKPOINT") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
