"""Sharding arithmetic: model state per rank under DeepSpeed ZeRO 1/2/3 (with offload) and FSDP2."""
from __future__ import annotations

from torch import nn

from ..checkpointing import ActivationCheckpointing
from .static import unique_params


def zero_per_rank(params: int, grads: int, optim: int, world: int, stage: int,
                  offload_optimizer: bool = False, offload_params: bool = False) -> int:
    """Model-state bytes per rank (ZeRO paper, Rajbhandari et al. 2020, section 5): stage 1
    partitions the optimizer state over ``world`` ranks, stage 2 also the gradients, stage 3
    also the parameters. Offloading moves the optimizer state (ZeRO-Offload) and, with
    stage 3, the parameters (ZeRO-Infinity) to host memory."""
    part = lambda x: -(-x // world)  # noqa: E731 - ceil: the last rank's share
    p = part(params) if stage >= 3 else params
    g = part(grads) if stage >= 2 else grads
    o = part(optim) if stage >= 1 else optim
    return (0 if offload_params and stage >= 3 else p) + g + (0 if offload_optimizer else o)


# ------------------------------------------------------------------ FSDP2 (fully_shard)


def fsdp_units(model: nn.Module, blocks) -> list[tuple[str, int]]:
    """(name, parameters) of every unit FSDP gathers whole: each block, and the root's own
    parameters (everything outside the blocks: embeddings, final norm, head)."""
    units, in_blocks = [], set()
    for name, module in ActivationCheckpointing(types=list(blocks)).chosen(model):
        params = unique_params(module)
        in_blocks |= {id(p) for p in params}
        units.append((name, sum(p.numel() for p in params)))
    units.append(("the root", sum(p.numel() for p in unique_params(model) if id(p) not in in_blocks)))
    return units


def fsdp_per_rank(sharded: int, unit: int, world: int, offload: bool = False) -> int:
    """FSDP2's bytes per rank: parameters, gradients and optimizer state divided over ``world``
    ranks (the ceiling: the last rank's share; in host memory with ``engine.offload=cpu``), plus
    the largest unit gathered whole with its unsharded gradients before the reduce-scatter
    (``unit``: its parameter bytes in the compute dtype, counted twice)."""
    return (0 if offload else -(-sharded // world)) + 2 * unit
