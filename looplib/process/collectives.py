"""The verbs that talk to the other ranks of a job, the same whatever the engine: a mean or a sum
over ranks, a flag raised on any rank, rank 0's value everywhere, one config for every rank, a
barrier. An engine names the class that answers them for it (``Engine.collectives``; the object:
``engine.ranks``): ``Ranks`` for one process (every answer is this process's own), ``GroupRanks``
for one rank of a process group (DDP, FSDP, DeepSpeed; the group starts on the first verb that
needs it, ``looplib.process.group.start``).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .group import start


class Ranks:
    """One process: nothing to compare, nothing to gather."""

    def __init__(self, engine):
        self.engine = engine  # its device, rank and world size (learnt when the group starts)

    def agree(self, config: dict) -> None:
        """Every rank runs the same job, or none does: compared before anything is built (one
        process: nothing to compare)."""

    def shared_run_dir(self, run_dir: Path) -> Path:
        """The run directory every rank writes to (rank 0's; one process: its own)."""
        return run_dir

    def from_main(self, obj):
        """Rank 0's ``obj`` (a small picklable value) on every rank (one process: ``obj``)."""
        return obj

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average of a device tensor over ranks (for logged losses; one rank: itself)."""
        return value

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over ranks, on the engine's device (held-out losses and counts; one
        rank: itself)."""
        return value.to(self.engine.device)

    def items(self, items: int) -> float:
        """Loss-bearing items of the window across every rank, per rank (one rank: unchanged)."""
        return items

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (preemption is agreed, not guessed)."""
        return self.any_of(flag)[0]

    def any_of(self, *flags: bool) -> list[bool]:
        """``any`` of several flags in one all-reduce."""
        if self.engine.world_size == 1 or not dist.is_initialized():
            return [bool(f) for f in flags]
        t = torch.tensor([float(f) for f in flags], device=self.engine.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def barrier(self) -> None:
        """Wait for every rank (one process: nobody to wait for)."""


class GroupRanks(Ranks):
    """One rank of a process group; the group starts (``start``) on the first verb that needs it."""

    def agree(self, config: dict) -> None:
        """The ranks compare their resolved configs before anything is built (the process group
        starts here); a difference (a value read from a per-rank environment variable, a launcher
        script, a clock-based seed) is refused on every rank, naming the keys."""
        start(self.engine)
        refuse_disagreement(config)

    def shared_run_dir(self, run_dir: Path) -> Path:
        """Rank 0's run directory. Called before anything is built (a resume reads its checkpoint
        there before the engine is set up), so the process group starts here."""
        start(self.engine)
        return Path(broadcast_object(str(run_dir)))

    def from_main(self, obj):
        return broadcast_object(obj)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return mean_over_ranks(value)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(value.to(self.engine.device))

    def items(self, items: int) -> float:
        return items_per_rank(items, self.engine.device)

    def barrier(self) -> None:
        barrier()


def items_per_rank(items: int, device: torch.device) -> float:
    """Items of the window summed over ranks, divided by the world size. The gradients are
    *averaged* over ranks (DDP, DeepSpeed), so dividing each rank's summed loss by this makes
    the update sum(loss over every rank) / (items over every rank)."""
    world = dist.get_world_size()
    if world == 1:
        return items
    total = torch.tensor([items], dtype=torch.float64, device=device)
    dist.all_reduce(total)  # one scalar per window
    return total.item() / world


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size()
    if world == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / world


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def refuse_disagreement(config: dict) -> None:
    """Every rank gathers every rank's config; where they differ, every rank refuses alike."""
    configs = [None] * dist.get_world_size()
    dist.all_gather_object(configs, flat(config))
    keys = sorted({k for c in configs for k in c if any(c.get(k) != other.get(k) for other in configs)})
    if not keys:
        return
    shown = "; ".join(f"{k}: " + ", ".join(f"rank {r} {c.get(k)!r}" for r, c in enumerate(configs)
                                           if r == 0 or c.get(k) != configs[0].get(k))
                      for k in keys[:3]) + (f"; and {len(keys) - 3} more" if len(keys) > 3 else "")
    raise ConfigError(keys[0], f"the {len(configs)} processes were given different jobs ({shown})",
                      "give every process the same command and settings (no value read from a per-rank "
                      "environment variable, no clock-based seed): one run trains one configuration")


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
