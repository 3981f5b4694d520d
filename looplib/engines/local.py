"""The local engine: one process, one device. The base class of every engine.

An engine owns placement and gradient sync. The loop calls ``to_device``, ``accumulating`` and
``global_items``; the assembly (``looplib.run``) calls the rest around it: ``precision_for`` and
``check`` (build time), ``setup`` (the model), ``prepare`` (the optimizer, once built),
``unwrap``, ``full_weights`` and ``close``. Every engine answers them all, so
no caller branches on which engine it has. What an engine only names:

- ``engine.ranks``: the verbs that talk to the other ranks (mean, sum, any, rank 0's value, one
  config for all, the shared run directory, a barrier), answered by the process wing
  (``looplib.process.collectives``; the class: ``collectives``);
- ``checkpoint_format``: how its checkpoints hold model and optimizer state; the object that
  writes and reads them is the store wing's (``looplib.store.formats.of(engine)``, kept as
  ``engine.checkpoints``).
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..atomic import as_umask
from ..errors import ConfigError
from ..process.collectives import Ranks


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when present, else cpu; a CUDA device asked of a machine without one is refused."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError("device", f"{name!r} is not a device", "use device=auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{name} asked for, but this machine has no CUDA device",
                          "use device=auto or device=cpu")
    return device


class Prepared(NamedTuple):
    """What the loop trains with, after the engine has taken the model and the optimizer."""
    model: nn.Module
    optimizer: Any
    max_grad_norm: float | None   # None where the engine clips itself


class Engine:
    """Single process. Subclasses (DDP, DeepSpeed) override the verbs that differ."""

    rank, world_size = 0, 1
    # How a checkpoint holds model and optimizer state: ``looplib`` (model.safetensors + the
    # optimizer's state_dict, full tensors), ``dcp`` (torch.distributed.checkpoint shards, FSDP2)
    # or ``deepspeed`` (DeepSpeed's ZeRO partitions). The object that writes and reads it:
    # ``checkpoints`` (looplib.store.formats.of(engine) makes it for looplib's and dcp; an engine
    # with a format of its own sets it itself). The local engine, DDP and FSDP read both
    # looplib's and dcp (looplib.store.state_dicts); DeepSpeed only its own.
    checkpoint_format = "looplib"
    checkpoints = None
    collectives = Ranks  # the class of ``ranks``: one process (looplib.process.collectives)
    several_processes = False  # True: runs as one rank of several under a launcher (DDP, FSDP, DeepSpeed)
    # True: every rank holds the model's modules as they were built (local, DDP); False: the engine
    # shards or re-types parameters (FSDP, DeepSpeed), which a 4-bit base (+peft=qlora) takes only
    # where ``shards_4bit`` says so (FSDP: the packed weights stored in a float dtype)
    keeps_modules = True
    shards_4bit = False
    per_process = ("rank", "world_size", "device")  # differ from rank to rank: never part of the saved config

    def __init__(self, device: str | torch.device = "auto"):
        self.device = resolve_device(str(device))

    def precision_for(self, precision):
        """The precision the loop uses on this engine, chosen once at assembly and set up on the
        engine's device (FSDP: a loss scaler whose inf/NaN check is agreed across ranks;
        DeepSpeed: DeepSpeed's own scaling and step). Nothing replaces it later."""
        precision.setup(self.device)
        return precision

    def check(self, settings, precision, optim) -> None:
        """Refuse combinations this engine cannot run, at build time (before any model exists)."""

    def check_evaluation(self, evaluation) -> None:
        """Refuse a held-out evaluation strategy this engine cannot run, at build time."""

    def prepare(self, model: nn.Module, optimizer, settings) -> Prepared:
        """Hand the built optimizer to the engine; the loop uses what comes back."""
        return Prepared(model, optimizer, settings.max_grad_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper the engine put around it."""
        return model

    @cached_property
    def ranks(self) -> Ranks:
        """The verbs that talk to the other ranks of this job (``looplib.process.collectives``)."""
        return self.collectives(self)

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's whole state dict (keys as ``unwrap(model).state_dict()``'s; tied
        weights share a tensor). Collective: every rank calls it (sharding engines gather)."""
        return {name: t.detach() for name, t in self.unwrap(model).state_dict().items()}

    def close(self) -> None:
        """Tear down what ``setup`` started (a process group, ...)."""

    @property
    def label(self) -> str:
        """The engine's name in messages: the ``+engine=`` option (local, ddp, fsdp, deepspeed)."""
        name = type(self).__name__
        return "local" if name == "Engine" else name.lower()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def setup(self, model: nn.Module) -> nn.Module:
        """Move the model to the device (and wrap it, for distributed engines)."""
        return model.to(self.device)

    def to_device(self, batch):
        # non_blocking only helps (and is only safe) from pinned host memory
        def move(x):
            return x.to(self.device, non_blocking=x.is_pinned()) if isinstance(x, torch.Tensor) else x
        if isinstance(batch, dict):
            return {k: move(v) for k, v in batch.items()}
        return type(batch)(move(x) for x in batch)

    def accumulating(self, model: nn.Module, last: bool):
        """Context for one micro-batch's forward and backward; distributed engines skip the
        gradient all-reduce unless ``last`` (the micro-batch that closes the window)."""
        return nullcontext()

    def global_items(self, items: int) -> float:
        """Loss-bearing items of the window across every rank, per rank: what each rank divides its
        summed loss by, so that the averaged gradients are the whole window's (one rank: unchanged)."""
        return self.ranks.items(items)


def innermost(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def write_safetensors(module, path: Path) -> None:
    """``module.state_dict()`` (or a state dict itself; tied weights stored once) as safetensors,
    written beside the target and renamed: never a half-written file."""
    from safetensors.torch import save_model
    weights = module if isinstance(module, dict) else module.state_dict()
    tmp = path.with_name(path.name + ".tmp")
    save_model(_StateDict({name: plain(t) for name, t in weights.items()}), str(tmp))
    as_umask(tmp)  # safetensors writes 0600
    os.replace(tmp, path)


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass that holds one (torchao's fp8 all-gather weight
    under FSDP2 keeps the fp32 weight as ``_tensor``): safetensors reads a storage pointer that a
    wrapper does not have ("invalid python storage", seen on an H200 at the end of an fp8 + FSDP2
    run). Tied names still share the one inner tensor, so the file stores it once."""
    while type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        from torch.distributed.tensor import DTensor
        if isinstance(t, DTensor):  # a shard is not the weight: the engine gathers first (full_weights)
            raise TypeError("a sharded DTensor reached the export; gather the full state dict first")
        inner, _ = t.__tensor_flatten__()
        if len(inner) != 1:
            break
        t = getattr(t, inner[0])
    return t


class _StateDict:
    """A state dict in the shape ``save_model`` takes (it calls ``.state_dict()``)."""

    def __init__(self, weights: dict):
        self.weights = weights

    def state_dict(self) -> dict:
        return self.weights


Local = Engine
