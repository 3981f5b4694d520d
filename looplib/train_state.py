"""The run's counters: the optimizer step, where the data stream is, and the bad-step streak.

``fit`` advances them once per optimizer-step boundary (``end_window``); ``looplib.store.saving``
saves and restores them with the rest of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainState:
    step: int = 0            # optimizer-step boundaries reached (skipped steps included)
    epoch: int = 0           # epoch the data stream is in
    batches_seen: int = 0    # micro-batches consumed in that epoch (the resume position)
    bad_streak: int = 0      # consecutive boundaries without an optimizer update
    preempted: bool = False  # stopped early by a signal (SIGTERM, SIGUSR1, Ctrl-C), after saving
    extra: dict = field(default_factory=dict)
    # Skipped updates in this process, and the longest streak of them. Where a fused kernel
    # skipped on the device, these and bad_streak are device tensors, read when logging or saving.
    skipped: int | torch.Tensor = 0
    longest_streak: int | torch.Tensor = 0

    def end_window(self, epochs, updated: bool, skipped: torch.Tensor | None = None) -> None:
        """One optimizer-step boundary passed. ``updated``: the optimizer's hooks saw an update;
        ``skipped``: a device flag that overrides them (1.0: a fused kernel skipped the update)."""
        self.step += 1
        self.epoch, self.batches_seen = epochs.epoch, epochs.batches_seen
        if skipped is None:
            self.bad_streak = 0 if updated else self.bad_streak + 1
            self.skipped += not updated
            self.longest_streak = max(self.longest_streak, self.bad_streak)
        else:  # the same arithmetic on the device: no host-device sync
            self.bad_streak = (self.bad_streak + 1) * skipped
            self.skipped = self.skipped + skipped
            self.longest_streak = (torch.maximum(self.longest_streak, self.bad_streak)
                                   if torch.is_tensor(self.longest_streak)
                                   else self.bad_streak.clamp(min=self.longest_streak))
