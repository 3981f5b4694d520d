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

import inspect
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError

OPTIONAL_INPUTS = ("attention_mask", "position_ids")


class TokenCrossEntropy:
    """Next-token language modelling: batch = {"input_ids", "labels"}; labels equal to
    ``ignore_index`` (padding, prompt tokens) carry no loss and are not counted."""

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index
        self.accepted = weakref.WeakKeyDictionary()   # model -> the optional inputs its forward takes

    def __call__(self, model, batch) -> torch.Tensor:
        logits = model(batch["input_ids"], **self.inputs(model, batch))
        return F.cross_entropy(logits.flatten(0, -2).float(), batch["labels"].flatten(),
                               ignore_index=self.ignore_index, reduction="sum")

    def inputs(self, model, batch) -> dict:
        """``attention_mask``/``position_ids`` of the batch, for a model that takes them. A model
        without ``attention_mask`` (the bundled GPT) is given none: padding is on the right and
        attention causal, so real tokens never see it. Packed examples (``position_ids``) would
        see each other in a model without ``position_ids``: refused."""
        present = [k for k in OPTIONAL_INPUTS if k in batch]
        if not present:
            return {}
        if model not in self.accepted:
            self.accepted[model] = accepted_inputs(model)
        if "position_ids" in present and "position_ids" not in self.accepted[model]:
            raise ConfigError("data.pack", f"{type(model).__name__} takes no position_ids, so packed examples "
                              "would attend to one another", "use data.pack=false, or a transformers model (model=hf)")
        return {k: batch[k] for k in present if k in self.accepted[model]}

    def count(self, batch) -> int:
        labels, ids = batch["labels"], batch.get("input_ids")
        # (a batch of one repeated token is equal to its own shift: not a sign of the mistake)
        if ids is not None and labels.shape == ids.shape and torch.equal(labels, ids) \
                and bool((ids[..., 1:] != ids[..., :-1]).any()):
            raise ConfigError("data", "the batch's labels equal its input_ids: they are not shifted to the next "
                              "token, so the model would learn to copy its input",
                              "make labels[t] = input_ids[t+1] (looplib.data.next_token_example)")
        return int((labels != self.ignore_index).sum())


class SequenceCrossEntropy(TokenCrossEntropy):
    """Classification of whole sequences: batch = {"input_ids", "labels"[, "attention_mask"]}."""

    def __call__(self, model, batch) -> torch.Tensor:
        logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
        return F.cross_entropy(logits.float(), batch["labels"], ignore_index=self.ignore_index,
                               reduction="sum")


def accepted_inputs(model: nn.Module) -> frozenset:
    """Which of ``OPTIONAL_INPUTS`` ``model``'s forward takes, looking through wrappers that pass
    ``**kwargs`` on (DDP, torch.compile, peft, DeepSpeed) to the module they wrap."""
    params = inspect.signature(getattr(model, "forward", model)).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    found = named.intersection(OPTIONAL_INPUTS)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        inner = next((m for m in (getattr(model, a, None) for a in ("module", "_orig_mod", "base_model", "model"))
                      if isinstance(m, nn.Module) and m is not model), None)
        found |= accepted_inputs(inner) if inner is not None else set(OPTIONAL_INPUTS)
    return frozenset(found)
