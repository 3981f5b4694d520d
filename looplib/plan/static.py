"""Static memory, exact: weights, autocast's 16-bit weight copies, gradients and optimizer state,
in bytes equal to the real tensors' (``tests/cli/test_plan.py`` checks them against real runs).
Gradients and optimizer state count the parameters that train (LoRA: the adapter's only)."""
from __future__ import annotations

import copy
import functools
import math
from typing import Sequence

import torch
from torch import nn

from .. import optim as lo
from ..muon import Muon


def unique_params(model: nn.Module, trainable: bool = False) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():  # parameters() already skips tied duplicates
        if id(p) not in seen and (p.requires_grad or not trainable):
            seen.add(id(p))
            out.append(p)
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Every parameter's bytes; a 4-bit one (``+peft=qlora``) as it is stored: the packed weights
    and its quantisation constants (each storage once),
    or on the meta device as ``looplib.quantize.fourbit_bytes`` says it will be."""
    from ..quantize import fourbit_bytes, quant_tensors
    total, seen = 0, set()
    for p in unique_params(model):
        if getattr(p, "quant_state", None) is not None and getattr(p, "bnb_quantized", False):
            for t in [p, *quant_tensors(p)]:
                key = (t.device, t.untyped_storage().data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        elif hasattr(p, "fourbit"):  # planned on meta: PlannedLinear4bit
            total += fourbit_bytes(p.numel(), p.fourbit)
        else:
            total += nbytes(p)
    return total


def gradient_bytes(model: nn.Module) -> int:
    """``.grad`` has the parameter's dtype and shape."""
    return sum(nbytes(p) for p in unique_params(model, trainable=True))


MATMUL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def autocast_copy_bytes(model: nn.Module, dtype: torch.dtype | None, only_in: Sequence[str] = ()) -> int:
    """Under autocast each parameter of a matmul module (weights and biases) is cast once per
    forward to ``dtype`` and the copy is kept for backward: the mixed-precision "+2 bytes".

    ``only_in`` (module names): the copies of parameters used only inside those modules. Under an
    activation strategy on them (blocks, selective, offload) nothing on the device keeps these for
    backward: autocast's cache holds them to the end of forward, then they are freed (and made
    again, one module at a time, when it is recomputed; offload copies them to host memory)."""
    if dtype is None:
        return 0
    from ..quantize import is_4bit
    inside = {id(m) for name in only_in for m in model.get_submodule(name).modules()}
    seen: dict[int, nn.Parameter] = {}
    outside: set[int] = set()
    for module in model.modules():
        if isinstance(module, MATMUL_MODULES) and not is_4bit(module):  # 4-bit: dequantised per use, not cached
            for p in module.parameters(recurse=False):
                seen[id(p)] = p
                if only_in and id(module) not in inside:
                    outside.add(id(p))
    return sum(p.numel() * dtype.itemsize for k, p in seen.items() if p.is_floating_point() and k not in outside)


@functools.singledispatch
def state_rule(factory, model: nn.Module) -> int | None:
    """Optimizer state bytes by rule, for optimizers that cannot step on the meta device.
    ``None``: no rule, measure with one step on meta tensors (AdamW, SGD, most of torch.optim)."""
    return None


@state_rule.register
def _adafactor(factory: lo.Adafactor, model):
    scalar = torch.tensor(0.0).element_size()  # the per-parameter `step` tensor
    total = 0
    for p in unique_params(model, trainable=True):
        total += scalar
        if p.dim() >= 2:  # factored: one row and one column of second moments
            rows = math.prod(p.shape[:-1])
            cols = math.prod(p.shape[:-2]) * p.shape[-1]
            total += (rows + cols) * p.element_size()
        else:
            total += nbytes(p)
    return total


BNB_BLOCK = 256          # bitsandbytes' block size for 8-bit state (one fp32 absmax per block)
BNB_QMAP = 2 * 256 * 4   # two 256-entry fp32 quantisation maps, shared by all parameters


@state_rule.register
def _adam8bit(factory: lo.Adam8bit, model):
    """2 bytes/param (two uint8 moments) + per-256-block fp32 scales; tensors under
    ``min_8bit_size`` elements and (by default) embeddings keep two fp32 moments."""
    wide = {id(w) for w in lo.embedding_weights(model)} if factory.embeddings_32bit else set()
    total, any_8bit = 0, False
    for p in unique_params(model, trainable=True):
        n = p.numel()
        if n < factory.min_8bit_size or id(p) in wide:
            total += 2 * 4 * n
        else:
            any_8bit = True
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
    return total + (BNB_QMAP if any_8bit else 0)


@state_rule.register
def _adam8bit_ao(factory: lo.TorchaoAdam8bit, model):
    """torchao: uint8 codes + one scale (parameter dtype) per block for tensors of >= 4096 whole
    blocks' elements, plus a 256-entry map per moment; others: two moments in the parameter's dtype."""
    total = 0
    for p in unique_params(model, trainable=True):
        n = p.numel()
        total += torch.tensor(0.0).element_size()  # the per-parameter `step` tensor
        if n >= 4096 and n % factory.block_size == 0:
            total += 2 * (n + p.element_size() * (n // factory.block_size) + 256 * 4)
        else:
            total += 2 * nbytes(p)
    return total


@state_rule.register
def _muon(factory: Muon, model):
    """One momentum buffer per Muon matrix; AdamW's two moments and its ``step`` scalar for the rest."""
    from ..muon import hidden_matrices
    matrices = {id(p) for p in hidden_matrices(model, factory.blocks)}
    scalar = torch.tensor(0.0).element_size()
    return sum(nbytes(p) if id(p) in matrices else 2 * nbytes(p) + scalar for p in unique_params(model, trainable=True))


def optimizer_state_bytes_of(factory, model: nn.Module) -> int:
    """Bytes of the state ``factory``'s optimizer holds after its first step on ``model``."""
    rule = state_rule(factory, model)
    if rule is not None:
        return rule
    if getattr(factory, "impl", None) == "fused":  # fused kernels refuse meta tensors; the state is the same
        factory = copy.copy(factory)
        factory.impl = "foreach"
    groups = lo.param_groups(model, getattr(factory, "weight_decay", 0.0))
    meta = {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for g in groups for p in g["params"]}
    opt = factory.create([{**g, "params": [meta[id(p)] for p in g["params"]]} for g in groups])
    for p in meta.values():
        p.grad = torch.empty_like(p)
    opt.step()
    return state_tensor_bytes(opt)


def state_tensor_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state tensors, each storage once (shared tensors exist: 8-bit qmaps)."""
    seen, total = set(), 0
    for state in opt.state.values():
        for t in state.values():
            if torch.is_tensor(t):
                key = (t.device, t.untyped_storage()._cdata) if t.device.type == "meta" else \
                      (t.device, t.untyped_storage().data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(job, default: int | None = None) -> int:
    """For a built ``train.Job``: the optimizer state its first step will allocate (``default``
    when a third-party optimizer can neither step on meta tensors nor has a ``state_rule``)."""
    try:
        return optimizer_state_bytes_of(job.optim, job.model)
    except Exception:  # noqa: BLE001
        if default is None:
            raise
        return default


def adam8bit_rule(model: nn.Module) -> int:
    factory = object.__new__(lo.Adam8bit)  # settings only: no bitsandbytes import for a what-if
    factory.min_8bit_size, factory.embeddings_32bit = 4096, True
    return _adam8bit(factory, model)
