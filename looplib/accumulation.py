"""Gradient accumulation: group micro-batches into windows, one optimizer step per window.

The window is formed *before* any forward pass so its item count is known up front: each
micro-batch's summed loss is divided by the count of the whole window (not averaged per
micro-batch, which is wrong when micro-batches hold different numbers of tokens). The last
window of an epoch may be shorter; it still makes one update, normalised by its own count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


@dataclass
class Window:
    batches: list[Any]
    items: int           # loss-bearing items (tokens or samples) in the whole window
    samples: int         # sequences in the whole window

    def __len__(self):
        return len(self.batches)


class Accumulation:
    """``steps`` micro-batches per optimizer step (the top-level ``accum_steps``)."""

    def __init__(self, steps: int = 1):
        self.steps = steps

    def windows(self, epochs: Iterable[Iterable[Any]], count: Callable[[Any], int]) -> Iterator[Window]:
        """``epochs`` yields one iterable of micro-batches per epoch."""
        for batches in epochs:
            window: list[Any] = []
            for batch in batches:
                window.append(batch)
                if len(window) == self.steps:
                    yield self.close(window, count)
                    window = []
            if window:  # the end of the epoch: a short window, not a lost update
                yield self.close(window, count)

    @staticmethod
    def close(window, count) -> Window:
        return Window(window, max(1, sum(count(b) for b in window)), sum(batch_size(b) for b in window))


def batch_size(batch) -> int:
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(first)


# The micro-batch x accumulation splits of a global batch (batch_size=auto, python -m looplib.plan)
MULTIPLE = 8  # tensor cores like dimensions that are multiples of 8


def candidates(per_rank: int) -> tuple[list[int], list[int]]:
    """Divisors of the per-rank global batch: multiples of 8 (tried smallest first, until one
    does not fit), and the others (tried largest first when not even the first one fits)."""
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    eights = [d for d in divisors if d % MULTIPLE == 0]
    small = [d for d in reversed(divisors) if d < (eights[0] if eights else per_rank + 1)]
    return eights, small
