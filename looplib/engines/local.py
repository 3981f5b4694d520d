"""The local engine: one process, one device. The base class of every engine.

The loop calls ``to_device``, ``accumulating`` and ``global_items``; the assembly
(``looplib.run``) calls the rest around it: ``precision_for`` and ``check`` (build time),
``setup`` (the model), ``prepare`` (the optimizer, once built), ``shared_run_dir``,
``mean_across_ranks`` (for logged losses), ``export_weights`` and ``close``. Every engine answers
them all, so no caller branches on which engine it has.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from ..atomic import as_umask
from ..errors import ConfigError


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
    # True: the engine writes and reads the model and optimizer state of a checkpoint itself
    # (``save_checkpoint`` / ``load_checkpoint``: FSDP's and DeepSpeed's sharded formats)
    own_checkpoints = False
    # How a checkpoint holds model and optimizer state: ``looplib`` (model.safetensors + the
    # optimizer's state_dict, full tensors), ``dcp`` (torch.distributed.checkpoint shards, FSDP2)
    # or ``deepspeed`` (DeepSpeed's ZeRO partitions). The local engine, DDP and FSDP read both
    # looplib's and dcp (looplib.engines.state_dicts); DeepSpeed only its own.
    checkpoint_format = "looplib"
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

    def agree(self, config: dict) -> None:
        """Every rank runs the same job, or none does: compared before anything is built (one
        process: nothing to compare)."""

    def check_evaluation(self, evaluation) -> None:
        """Refuse a held-out evaluation strategy this engine cannot run, at build time."""

    def prepare(self, model: nn.Module, optimizer, settings) -> Prepared:
        """Hand the built optimizer to the engine; the loop uses what comes back."""
        return Prepared(model, optimizer, settings.max_grad_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper the engine put around it."""
        return model

    def shared_run_dir(self, run_dir: Path) -> Path:
        """The run directory every rank writes to (rank 0's; one process: its own)."""
        return run_dir

    def from_main(self, obj):
        """Rank 0's ``obj`` (a small picklable value) on every rank (one process: ``obj``)."""
        return obj

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Average of a device tensor over ranks (for logged losses; one rank: itself)."""
        return value

    def sum_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over ranks, on this engine's device (held-out losses and counts; one
        rank: itself)."""
        return value.to(self.device)

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The user module's whole state dict (keys as ``unwrap(model).state_dict()``'s; tied
        weights share a tensor). Collective: every rank calls it (sharding engines gather)."""
        return {name: t.detach() for name, t in self.unwrap(model).state_dict().items()}

    def export_weights(self, model: nn.Module, path: Path) -> None:
        """The trained weights as safetensors. Every rank calls it (sharding engines gather in
        ``full_weights``); the main rank writes."""
        weights = self.full_weights(model)
        if self.is_main:
            write_safetensors(weights, Path(path))

    def close(self) -> None:
        """Tear down what ``setup`` started (a process group, ...)."""

    @property
    def label(self) -> str:
        """The engine's name in messages: the ``+engine=`` option (local, ddp, fsdp, deepspeed)."""
        name = type(self).__name__
        return "local" if name == "Engine" else name.lower()

    def save_checkpoint(self, directory: str | Path, client_state: dict | None = None, tag: str | None = None) -> None:
        """Write model, optimizer and ``client_state`` into ``directory/tag`` in the engine's own
        format (engines with ``own_checkpoints`` only; the others' are written by looplib)."""
        raise NotImplementedError(f"{type(self).__name__} does not write checkpoints of its own")

    def stage_checkpoint(self, directory: str | Path, client_state: dict, tag: str, stage) -> Callable[[], None]:
        """``save_checkpoint`` in two halves (``checkpoint.async``): copy this rank's part off the
        device now with ``stage`` (a function of a tree of tensors), and return the function that
        writes the copy (on a background thread; every rank's part is on disk when it returns on
        rank 0). Engines with ``own_checkpoints`` only."""
        raise NotImplementedError(f"{type(self).__name__} does not write checkpoints of its own")

    def load_checkpoint(self, directory: str | Path, tag: str | None = None) -> dict:
        """Restore what ``save_checkpoint`` wrote; return the client state."""
        raise NotImplementedError(f"{type(self).__name__} does not read checkpoints of its own")

    def load_full_state(self, model: nn.Module, optimizer, weights: Path, optimizer_state: dict) -> None:
        """Load looplib's own checkpoint files (``weights``: model.safetensors; the optimizer's
        ``state_dict()``) into the model and optimizer this engine prepared."""
        from safetensors.torch import load_model
        load_model(innermost(model), str(weights))
        optimizer.load_state_dict(optimizer_state)

    def resuming(self, checkpoint: Path, saved_world: int, scratch: Path) -> None:
        """Told before ``prepare`` which checkpoint the run resumes and how many processes wrote
        it (DeepSpeed then loads through a universal checkpoint, made in ``scratch``: this run's
        checkpoint directory, on the file system every rank shares). Nothing to do here."""

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (preemption is agreed, not guessed)."""
        return self.any_ranks(flag)[0]

    def any_ranks(self, *flags: bool) -> list[bool]:
        """``any_rank`` of several flags in one all-reduce."""
        import torch.distributed as dist
        if self.world_size == 1 or not dist.is_initialized():
            return [bool(f) for f in flags]
        t = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

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

    def global_items(self, items: int) -> int:
        """Loss-bearing items of the window across every rank (one rank: unchanged)."""
        return items


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
