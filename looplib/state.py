"""The old import path of the saved-state modules (kept for code that imports ``looplib.state``).

New code imports from the module of each concern: ``looplib.train_state`` (the counters),
``looplib.checkpoints`` (saving), ``looplib.checkpoint_files`` (reading and checking a
checkpoint directory), ``looplib.resume`` (what a resume continues from and accepts).
"""
from .checkpoint_files import (InvalidCheckpoint, find_checkpoint, inspect_checkpoint, is_valid,  # noqa: F401
                               load_state, sha256, step_dirs, unwrap)
from .checkpoints import EXIT_IO, EXIT_NUMERIC, Checkpoints, NumericError, SaveError  # noqa: F401
from .resume import SAFE_TO_CHANGE, check_resume_config, config_changes, resume  # noqa: F401
from .signals import EXIT_INTERRUPTED, EXIT_PREEMPTED  # noqa: F401
from .train_state import TrainState  # noqa: F401
