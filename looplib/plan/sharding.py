"""Sharding arithmetic: model state per rank under DeepSpeed ZeRO 1/2/3 (with offload) and FSDP2, and the
layout FSDP2 gives a 4-bit base (``Sharded4bit``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..activations import ActivationCheckpointing
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


# ------------------------------------------------------------------ a 4-bit base under FSDP2


@dataclass
class Sharded4bit:
    """How FSDP2 holds a 4-bit base (``+peft=qlora +engine=fsdp``; ``looplib.peft.QLoRA``): the
    packed weights in the compute dtype (bitsandbytes' ``quant_storage``), the frozen rest in the
    compute dtype when it is 16-bit, the adapters in fp32, each sharded by rows (FSDP2's ``Shard(0)``:
    ``ceil(rows / world)`` rows on every rank); the quantisation constants whole on every rank."""
    tensors: list[tuple[str, int, int]]  # (packed | frozen | adapters, rows, bytes per row), one per parameter
    constants: int                       # bytes of every layer's quantisation constants (whole on each rank)
    unit: tuple[str, int]                # the largest block as gathered for compute: (name, bytes)
    root: int                            # the root's own parameters as gathered (embeddings, final norm, head)
    unit_grads: int                      # the adapters' unsharded gradients of the root and that block

    @property
    def gathered(self) -> int:
        """Gathered at once: the root (looplib's FSDP keeps it gathered from forward into backward),
        the block that computes and the next one, prefetched; their adapters' unsharded gradients."""
        return self.root + 2 * self.unit[1] + self.unit_grads

    def per_rank(self, world: int) -> dict[str, int]:
        """Bytes each rank holds: packed weights, frozen rest, adapters and their gradients (same
        shapes and dtype), all as the last rank's share (padded), and the constants whole."""
        out = {"packed": 0, "frozen": 0, "adapters": 0}
        for kind, rows, row in self.tensors:
            out[kind] += -(-rows // world) * row
        return {**out, "gradients": out["adapters"], "constants": self.constants}


def sharded_4bit(model: nn.Module, blocks, dtype: torch.dtype | None) -> Sharded4bit:
    """The layout of ``model`` (wrapped by QLoRA on the meta device: ``PlannedLinear4bit`` weights
    carry ``fourbit``) under FSDP2 computing in ``dtype`` (None: fp32)."""
    from ..quantize import fourbit_bytes
    compute = dtype or torch.float32
    size = compute.itemsize
    half = compute in (torch.bfloat16, torch.float16)

    def layout(p) -> tuple[str, int, int, int]:
        """(kind, rows, bytes per row as stored, bytes as gathered for compute)"""
        n = p.numel()
        if hasattr(p, "fourbit"):  # bitsandbytes: (n + 1) // (2 x storage bytes) rows of one element
            rows = (n + 1) // (2 * size)
            return "packed", rows, size, rows * size
        rows = p.shape[0] if p.dim() else 1
        stored = size if half and not p.requires_grad else p.element_size()
        return ("adapters" if p.requires_grad else "frozen"), rows, n // rows * stored, n * (size if half else stored)

    params = unique_params(model)
    tensors = [layout(p)[:3] for p in params]
    constants = sum(fourbit_bytes(p.numel(), p.fourbit) - -(-p.numel() // 2) for p in params if hasattr(p, "fourbit"))
    in_blocks, units = set(), []
    for name, module in [*ActivationCheckpointing(types=list(blocks)).chosen(model), ("the root", model)]:
        own = [p for p in unique_params(module) if id(p) not in in_blocks]
        in_blocks |= {id(p) for p in own}
        grads = sum(p.numel() * (size if half else p.element_size()) for p in own if p.requires_grad)
        units.append((name, sum(layout(p)[3] for p in own), grads))
    root = units.pop()
    name, gathered, grads = max(units, key=lambda u: u[1], default=("-", 0, 0))
    return Sharded4bit(tensors, constants, (name, gathered), root[1], grads + root[2])
