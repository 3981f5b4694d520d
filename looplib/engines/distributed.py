"""What every multi-process engine shares (DDP, FSDP, DeepSpeed): the rank and device a launcher
gave this process, and the process group's collectives (``looplib.process.collectives.GroupRanks``)."""
from __future__ import annotations

import torch

from ..process.collectives import GroupRanks
from ..process.launcher import launched_rank, process_device
from .local import Engine, resolve_device


def class_name(cls: type) -> str:
    """``module.Class``: how the engines name an optimizer class they refuse."""
    return f"{cls.__module__}.{cls.__name__}"


class Distributed(Engine):
    """One process per device; the process group starts in ``setup`` (``looplib.process.group.start``),
    or before, with the first collective that needs it (``ranks.agree``, ``ranks.shared_run_dir``)."""

    collectives = GroupRanks

    def __init__(self, device: str | torch.device = "auto", timeout_s: float = 1800):
        self.device = process_device(resolve_device(str(device)))  # cuda -> cuda:LOCAL_RANK
        self.rank, self.timeout_s = launched_rank(), timeout_s    # the process group comes in setup

    def close(self) -> None:
        # A sweep (-m) runs several jobs in one process, so the process group lives until the
        # process exits (looplib.process.group.init_process_group registered its teardown); here,
        # wait for peers.
        self.ranks.barrier()
