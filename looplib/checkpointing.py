"""Activation checkpointing: recompute chosen submodules' activations in backward.

Not to be confused with the saved-state checkpoints of the top-level ``checkpoint:`` settings
(saving a run to disk: ``looplib/checkpoints.py``, ``checkpoint_files.py``, ``resume.py``): this module trades compute for activation memory with ``torch.utils.checkpoint``
(``use_reentrant=False``, the variant that works with DDP, keyword arguments and
inputs that do not require grad).

A wrapped submodule keeps its class, its parameters' names and its hooks: only its
``forward`` attribute is replaced (``state_dict`` keys, safetensors files and resume are
unchanged). ``model.forward`` under ``torch.no_grad()`` / inference mode runs the original.
"""
from __future__ import annotations

import functools
import logging
import re
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import ConfigError
from .schema import Positive

log = logging.getLogger("looplib")


class Checkpointing:
    """No activation checkpointing: the null object (``+checkpointing=none``)."""

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def wrapped(self, model: nn.Module) -> list[str]:
        return []


NoCheckpointing = Checkpointing


class ActivationCheckpointing(Checkpointing):
    """Checkpoint every ``every``-th submodule whose class (or a base class) is one of ``types``
    (class names such as ``Block``, ``GPT2Block``, ``BertLayer``, transformers' base of every
    decoder/encoder layer ``GradientCheckpointingLayer``, or dotted paths) or whose qualified name
    matches the regular expression ``names`` (e.g. ``blocks\\.\\d+``). A match inside an
    already chosen submodule is skipped (checkpointing the outer one covers it)."""

    def __init__(self, types: Sequence[str] = (), names: str | None = None, every: Positive[int] = 1):
        if not types and not names:
            raise ConfigError("checkpointing", "neither checkpointing.types nor checkpointing.names is set",
                              "name module classes (checkpointing.types=[Block]) or a name pattern")
        if every < 1:
            raise ConfigError("checkpointing.every", f"every must be at least 1 (got every={every})",
                              "use 1 to checkpoint every matching module, 2 for every other one")
        try:
            self.pattern = re.compile(names) if names else None
        except re.error as err:
            raise ConfigError("checkpointing.names", f"{names!r} is not a regular expression ({err})",
                              "use e.g. checkpointing.names='blocks\\.\\d+'") from None
        self.types, self.names, self.every = tuple(types), names, every

    def matches(self, name: str, module: nn.Module) -> bool:
        # a class or any base class: GradientCheckpointingLayer names every transformers block
        for cls in type(module).__mro__[:-1]:
            if cls.__name__ in self.types or f"{cls.__module__}.{cls.__qualname__}" in self.types:
                return True
        return bool(self.pattern and name and self.pattern.fullmatch(name))

    def chosen(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        found, inside = [], ()
        for name, module in model.named_modules():
            if inside and any(name.startswith(prefix + ".") for prefix in inside):
                continue
            if self.matches(name, module):
                found.append((name, module))
                inside = inside + (name,)
        return found[:: self.every]

    def apply(self, model: nn.Module) -> nn.Module:
        chosen = self.chosen(model)
        if not chosen:
            what = " or ".join(filter(None, [f"types={list(self.types)}" if self.types else "",
                                             f"names={self.names!r}" if self.names else ""]))
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError("checkpointing", f"no submodule of {type(model).__name__} matches {what}",
                              f"choose among its module classes: {', '.join(classes)}")
        for _, module in chosen:
            checkpoint_module(module)
        log.info("activation checkpointing: %d of %s's submodules (%s ...)", len(chosen),
                 type(model).__name__, chosen[0][0])
        return model

    def wrapped(self, model: nn.Module) -> list[str]:
        return [name for name, m in model.named_modules() if is_checkpointed(m)]


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module``'s forward run under ``torch.utils.checkpoint`` (idempotent)."""
    if is_checkpointed(module):
        return
    # a partial of a module-level function, not a closure: copy.deepcopy and pickle follow
    # the module (an EMA copy checkpoints its own forward, not the original's)
    module.forward = functools.partial(checkpointed_forward, module, module.__dict__.get("forward"))


def is_checkpointed(module: nn.Module) -> bool:
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is checkpointed_forward


def checkpointed_forward(module: nn.Module, inner, *args, **kwargs):
    forward = inner if inner is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():  # eval, generation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
