"""What every multi-process engine shares (DDP, FSDP, DeepSpeed): the rank and device a launcher
gave this process, and the verbs that talk to the other ranks the same way whatever the engine."""
from __future__ import annotations

from pathlib import Path

import torch

from . import launch
from .local import Engine, resolve_device


def class_name(cls: type) -> str:
    """``module.Class``: how the engines name an optimizer class they refuse."""
    return f"{cls.__module__}.{cls.__name__}"


class Distributed(Engine):
    """One process per device; the process group starts in ``setup`` (``launch.start``)."""

    def __init__(self, device: str | torch.device = "auto", timeout_s: float = 1800):
        self.device = launch.process_device(resolve_device(str(device)))  # cuda -> cuda:LOCAL_RANK
        self.rank, self.timeout_s = launch.launched_rank(), timeout_s    # the process group comes in setup

    def agree(self, config: dict) -> None:
        """The ranks compare their resolved configs before anything is built (the process group
        starts here); a difference (a value read from a per-rank environment variable, a launcher
        script, a clock-based seed) is refused on every rank, naming the keys."""
        launch.start(self)
        launch.refuse_disagreement(config)

    def from_main(self, obj):
        return launch.broadcast_object(obj)

    def global_items(self, items: int) -> float:
        return launch.items_per_rank(items, self.device)

    def mean_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return launch.mean_over_ranks(value)

    def sum_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return launch.sum_over_ranks(value.to(self.device))

    def shared_run_dir(self, run_dir: Path) -> Path:
        """Rank 0's run directory. Called before anything is built (a resume reads its checkpoint
        there before the engine is set up), so the process group starts here."""
        launch.start(self)
        return Path(launch.broadcast_object(str(run_dir)))

    def close(self) -> None:
        # A sweep (-m) runs several jobs in one process, so the process group lives until the
        # process exits (launch.init_process_group registered its teardown); here, wait for peers.
        launch.barrier()
