"""How held-out loss is computed: with the training weights (the null object), or with a
half-precision copy of them (``+evaluation=bf16`` / ``fp16``: the guides' "full fp16/bf16 eval").

The held-out loss is a property of the weights: the sum of the loss over every loss-bearing item
(token) of a fixed set of held-out sequences, divided by their number, whatever the micro-batch,
the accumulation, the number of processes or the engine. The set is chosen once
(``looplib.data.loading.held_out``: ``eval_samples`` sequences spread evenly over the held-out
split, each rank a share of them); ``evaluate`` sums losses and counts on each rank (in float64)
and adds them up across ranks before dividing.

A strategy is any callable ``(model, batches, objective, precision, engine) -> float``, the
signature of ``evaluate`` (below); ``fit(..., evaluator=...)`` takes one. A strategy that casts the
model's weights says so (``casts_weights``): an engine that shards them (FSDP) refuses it.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from .errors import ConfigError
from .precision import Precision

if TYPE_CHECKING:  # the engine is only passed through: no import of the floor above
    from .engines.local import Engine

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.inference_mode()
def evaluate(model: nn.Module, batches, objective, precision: Precision, engine: Engine) -> float:
    """Loss per item over ``batches`` and over every rank's own batches (the engine adds the
    sums and the counts up), under the precision context, in inference mode. Every rank calls
    it with as many batches as the others (a sharded model's forward is collective)."""
    was_training = model.training
    model.eval()
    wide = torch.float32 if engine.device.type == "mps" else torch.float64  # (MPS has no float64)
    total, items = torch.zeros((), dtype=wide, device=engine.device), 0
    for batch in batches:
        items += objective.count(batch)
        with precision.autocast():
            total += objective(model, engine.to_device(batch)).to(wide)
    model.train(was_training)
    sums = engine.ranks.sum(torch.stack([total, torch.tensor(float(items), dtype=wide, device=engine.device)]))
    total, items = sums.tolist()
    return total / max(items, 1)


def metrics_of(objective, engine: Engine) -> dict:
    """The objective's other held-out metrics (a classifier's accuracy), over every rank: an
    ``eval_metrics`` that takes ``reduce`` is given the engine's sum across ranks."""
    metrics = objective.eval_metrics
    if "reduce" in inspect.signature(metrics).parameters:
        return metrics(reduce=engine.ranks.sum)
    return metrics()


class Scores(float):
    """The held-out loss, carrying the objective's other metrics (a classifier's accuracy)."""

    def __new__(cls, loss: float, metrics: dict):
        self = super().__new__(cls, loss)
        self.metrics = metrics
        return self


def scored(loss: float, objective, engine: Engine) -> float:
    return Scores(loss, metrics_of(objective, engine)) if hasattr(objective, "eval_metrics") else loss


class Evaluation:
    """Evaluate the training model as it is, under the training precision's autocast."""

    casts_weights = False  # True: swaps every parameter's .data for a cast copy while evaluating

    def __call__(self, model, batches, objective, precision, engine) -> float:
        return scored(evaluate(model, batches, objective, precision, engine), objective, engine)


class HalfWeights(Evaluation):
    """Evaluate with every floating-point weight and buffer cast to ``dtype``, no autocast.

    The fp32 weights are set aside (not copied) and put back afterwards, bit for bit, so the
    cost is one half-precision copy of the weights (2 bytes/parameter) for the duration of
    the evaluation. Matmuls then run in 16 bits with no per-op casting: faster than autocast
    on tensor-core GPUs, and an eval-only run needs half the weight memory.
    """

    casts_weights = True

    def __init__(self, dtype: Literal["bfloat16", "float16"] = "bfloat16"):
        if dtype not in HALF:
            raise ConfigError("evaluation.dtype", f"{dtype!r} is not a half-precision dtype",
                              "use bfloat16 or float16")
        self.dtype = HALF[dtype]

    def __call__(self, model, batches, objective, precision, engine) -> float:
        with cast_weights(model, self.dtype):
            return scored(evaluate(model, batches, objective, Precision(), engine), objective, engine)


@contextmanager
def cast_weights(model: nn.Module, dtype: torch.dtype):
    """Within the block, every floating-point parameter and buffer of ``model`` is ``dtype``."""
    saved = []
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):  # tied weights appear once
            if t.is_floating_point() and t.dtype != dtype:
                saved.append((t, t.data))
                t.data = t.data.to(dtype)
    try:
        yield model
    finally:
        for t, original in saved:
            t.data = original
