"""Objectives: run the model on a batch and return the *summed* loss, and count its items.

The loop divides the summed loss by the number of loss-bearing items in the whole
accumulation window (see ``accumulation.py``), so (batch B, accumulation 1) and
(batch B/k, accumulation k) give the same update even when micro-batches hold different
numbers of tokens.

Bring your own: any object with

    __call__(model, batch) -> scalar tensor, the loss summed over the batch's items
    count(batch) -> int, how many items that sum is over (computed on the host batch)

works as ``loss._target_=my_pkg.MyObjective``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TokenCrossEntropy:
    """Next-token language modelling: batch = {"input_ids", "labels"}; labels equal to
    ``ignore_index`` (padding, prompt tokens) carry no loss and are not counted."""

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def __call__(self, model, batch) -> torch.Tensor:
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, -2).float(), batch["labels"].flatten(),
                               ignore_index=self.ignore_index, reduction="sum")

    def count(self, batch) -> int:
        return int((batch["labels"] != self.ignore_index).sum())


class SequenceCrossEntropy(TokenCrossEntropy):
    """Classification of whole sequences: batch = {"input_ids", "labels"[, "attention_mask"]}."""

    def __call__(self, model, batch) -> torch.Tensor:
        logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
        return F.cross_entropy(logits.float(), batch["labels"], ignore_index=self.ignore_index,
                               reduction="sum")
