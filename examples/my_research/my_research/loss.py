"""A loss: label-smoothed next-token cross-entropy that reports its item count.

looplib's objective contract: ``__call__(model, batch)`` returns the loss *summed* over the
batch's items, ``count(batch)`` says how many items that is. The loop divides by the count
of the whole accumulation window, so (batch 8, accumulation 1) and (batch 2, accumulation 4)
make the same update even when micro-batches hold different numbers of counted tokens.
"""
from __future__ import annotations

import torch.nn.functional as F

from looplib.loss import TokenCrossEntropy


class LabelSmoothedLM(TokenCrossEntropy):
    def __init__(self, smoothing: float = 0.1, ignore_index: int = -100):
        super().__init__(ignore_index)
        self.smoothing = smoothing

    def __call__(self, model, batch):
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, -2).float(), batch["labels"].flatten(),
                               ignore_index=self.ignore_index, label_smoothing=self.smoothing,
                               reduction="sum")

    # count(batch) is inherited: labels that are not ignore_index (computed on the host batch)
