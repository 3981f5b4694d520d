"""Learning-rate schedules: the group ``schedule`` (``+schedule=cosine``, ``conf/schedule/``).

A schedule holds its settings from the config and builds the scheduler once the optimizer
exists (``build(optimizer, total_steps)``); ``factor(step, total_steps)`` multiplies the base lr.
"""
from __future__ import annotations

import math

import torch

from .errors import ConfigError
from .schema import Fraction, NonNegative


class Schedule:
    """Constant learning rate: the null schedule. ``factor(step)`` multiplies the base lr."""

    def build(self, optimizer: torch.optim.Optimizer, total_steps: int):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.factor(step, total_steps))

    def factor(self, step: int, total_steps: int) -> float:
        return 1.0


Constant = Schedule


class WarmupCosine(Schedule):
    """Linear warm-up from 0 over ``warmup_steps``, then cosine decay to ``min_ratio`` x lr."""

    def __init__(self, warmup_steps: NonNegative[int] = 25, min_ratio: Fraction = 0.1):
        if warmup_steps < 0 or not 0.0 <= min_ratio <= 1.0:
            raise ConfigError("schedule", f"warmup_steps={warmup_steps}, min_ratio={min_ratio}",
                              "use warmup_steps >= 0 and 0 <= min_ratio <= 1")
        self.warmup_steps, self.min_ratio = warmup_steps, min_ratio

    def factor(self, step, total_steps):
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
