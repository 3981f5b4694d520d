"""The local engine: one process, one device. The base class of every engine."""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

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


class Engine:
    """Single process. Subclasses (DDP, DeepSpeed) override the verbs that differ."""

    rank, world_size = 0, 1

    def __init__(self, device: str | torch.device = "auto"):
        self.device = resolve_device(str(device))

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


Local = Engine
