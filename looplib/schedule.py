"""Learning-rate schedules: the group ``schedule`` (``+schedule=cosine``, ``conf/schedule/``).

A schedule holds its settings from the config and builds the scheduler once the optimizer
exists (``build(optimizer, total_steps)``); ``factor(step, total_steps)`` multiplies the base lr;
``check(total_steps)`` refuses a schedule that cannot run its course in max_steps (a warm-up as long
as the run) before anything is built (``looplib.run.assembly.check``; every way in meets it).
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from .errors import ConfigError
from .schema import Fraction, NonNegative


class Schedule:
    """Constant learning rate: the null schedule. ``factor(step)`` multiplies the base lr."""

    def build(self, optimizer: torch.optim.Optimizer, total_steps: int):
        self.check(total_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.factor(step, total_steps))

    def factor(self, step: int, total_steps: int) -> float:
        return 1.0

    def check(self, total_steps: int) -> None:
        """Refuse settings this schedule cannot run in ``total_steps`` (max_steps): nothing to refuse here."""

    def moved(self, step: int, saved_total: int, total: int) -> str | None:
        """What a resume that changes max_steps does to this schedule at ``step`` (None: nothing):
        the factor is recomputed over the new max_steps, so a run resumed inside a cool-down with more
        steps goes back up (WSD: to its peak) and a cosine stretches from where it stood."""
        if saved_total == total:
            return None
        before, after = self.factor(step, saved_total), self.factor(step, total)
        if abs(before - after) < 1e-12:
            return None
        way = "rises" if after > before else "falls"
        return (f"max_steps {saved_total} -> {total} recomputes the {type(self).__name__} schedule over {total} steps: "
                f"at step {step} the lr {way} from {before:.4g} x lr to {after:.4g} x lr"
                + (" (back out of its cool-down)" if after > before and before < 1.0 else ""))


def fits(warmup_steps: int, total_steps: int, decay_steps: int = 0) -> None:
    """The rule every warm-up shares: it ends before max_steps (a run spent in warm-up never
    reaches its lr nor decays), and it does not overlap the cool-down's last ``decay_steps``."""
    if decay_steps and warmup_steps + decay_steps > total_steps:
        raise ConfigError("schedule.warmup_steps", f"the warm-up ({warmup_steps} steps) and the cool-down "
                          f"(the last {decay_steps} of max_steps={total_steps}) overlap",
                          "lower schedule.warmup_steps or schedule.decay_fraction, or raise max_steps")
    if warmup_steps >= total_steps:
        raise ConfigError("schedule.warmup_steps", f"the warm-up ({warmup_steps} steps) is as long as the run or "
                          f"longer (max_steps={total_steps}): the whole run would be spent in warm-up, the lr never "
                          "reaching lr nor decaying",
                          f"lower schedule.warmup_steps below max_steps (e.g. schedule.warmup_steps="
                          f"{total_steps // 10}), or raise max_steps")


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

    def check(self, total_steps):
        fits(self.warmup_steps, total_steps)


def warmup(step: int, warmup_steps: int) -> float | None:
    """The warm-up's factor at ``step`` (linear from 1/warmup_steps to 1), or None past it."""
    return (step + 1) / warmup_steps if step < warmup_steps else None


class Linear(Schedule):
    """Linear warm-up from 0 over ``warmup_steps``, then linear decay to ``min_ratio`` x lr at max_steps."""

    def __init__(self, warmup_steps: NonNegative[int] = 25, min_ratio: Fraction = 0.0):
        if warmup_steps < 0 or not 0.0 <= min_ratio <= 1.0:
            raise ConfigError("schedule", f"warmup_steps={warmup_steps}, min_ratio={min_ratio}",
                              "use warmup_steps >= 0 and 0 <= min_ratio <= 1")
        self.warmup_steps, self.min_ratio = warmup_steps, min_ratio

    def factor(self, step, total_steps):
        rising = warmup(step, self.warmup_steps)
        if rising is not None:
            return rising
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * (1 - progress)

    def check(self, total_steps):
        fits(self.warmup_steps, total_steps)


# the cool-down's shapes: the fraction of the way from min_ratio to 1, at progress p (0 -> 1)
SHAPES = {"linear": lambda p: 1 - p,
          "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
          "1-sqrt": lambda p: 1 - math.sqrt(p)}


class WSD(Schedule):
    """Warm-up, stable, decay: linear warm-up from 0 over ``warmup_steps``, the full lr until the
    last ``decay_fraction`` of max_steps, then a cool-down to ``min_ratio`` x lr at max_steps
    (``decay_shape``: linear, cosine or 1-sqrt). The cool-down's first step still has the full lr,
    its last 1/(cool-down steps) of the way above ``min_ratio`` (as cosine reaches ``min_ratio``
    at max_steps, one step after the last)."""

    def __init__(self, warmup_steps: NonNegative[int] = 25, decay_fraction: Fraction = 0.2,
                 decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear", min_ratio: Fraction = 0.0):
        if not 0.0 <= decay_fraction <= 1.0:
            raise ConfigError("schedule.decay_fraction", f"schedule.decay_fraction must be >= 0 and <= 1 "
                              f"(got schedule.decay_fraction={decay_fraction})",
                              "use the share of max_steps spent cooling down, e.g. schedule.decay_fraction=0.2")
        if decay_shape not in SHAPES:
            raise ConfigError("schedule.decay_shape", f"{decay_shape!r} is not a cool-down shape",
                              "use schedule.decay_shape=linear, cosine or 1-sqrt")
        if warmup_steps < 0 or not 0.0 <= min_ratio <= 1.0:
            raise ConfigError("schedule", f"warmup_steps={warmup_steps}, min_ratio={min_ratio}",
                              "use warmup_steps >= 0 and 0 <= min_ratio <= 1")
        self.warmup_steps, self.decay_fraction = warmup_steps, decay_fraction
        self.decay_shape, self.min_ratio = decay_shape, min_ratio

    def decay_steps(self, total_steps: int) -> int:
        """The cool-down's length: ``decay_fraction`` of max_steps, rounded (at least 1 when above 0)."""
        return max(1, round(self.decay_fraction * total_steps)) if self.decay_fraction else 0

    def check(self, total_steps):
        fits(self.warmup_steps, total_steps, self.decay_steps(total_steps))

    def factor(self, step, total_steps):
        rising = warmup(step, self.warmup_steps)
        if rising is not None:
            return rising
        decay = self.decay_steps(total_steps)
        start = total_steps - decay
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / decay)
        return self.min_ratio + (1 - self.min_ratio) * SHAPES[self.decay_shape](progress)
