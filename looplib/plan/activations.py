"""Activations saved for backward, estimated by running the model on the meta device (no memory,
no compute), with attention counted as a fused kernel saves it (q, k, v, output, logsumexp)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..checkpointing import ActivationCheckpointing, Checkpointing
from ..loss import SequenceCrossEntropy
from .static import nbytes


class MetaAutocast(TorchFunctionMode):
    """On meta tensors, do what autocast and a fused attention kernel would: matmuls in
    ``dtype`` (each parameter cast once), norms / softmax / losses in fp32, and scaled dot-
    product attention saving q, k, v, its output and the fp32 logsumexp (not the T x T matrix)."""

    LOW = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm, torch.addmm}
    FP32 = {F.layer_norm, F.softmax, F.log_softmax, F.cross_entropy, F.group_norm, torch.Tensor.softmax}

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype, self.copies = dtype, {}

    def cast(self, x, dtype):
        if not (torch.is_tensor(x) and x.is_floating_point()) or x.dtype == dtype:
            return x
        if isinstance(x, nn.Parameter):  # autocast's weight cache: one copy per forward
            if id(x) not in self.copies:
                self.copies[id(x)] = x.to(dtype)
            return self.copies[id(x)]
        return x.to(dtype)

    # data-dependent branches (transformers asks whether a mask is all ones, whether position
    # ids are packed) cannot be read on meta tensors: answer "no" and take the general path
    UNREADABLE = {torch.Tensor.__bool__: False, torch.Tensor.item: 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.UNREADABLE and args and torch.is_tensor(args[0]) and args[0].is_meta:
            return self.UNREADABLE[func]
        if func is F.scaled_dot_product_attention:
            q, k, v = (self.cast(t, self.dtype) if self.dtype else t for t in args[:3])
            return FusedAttention.apply(q, k, v)
        if self.dtype is not None and func in self.LOW:
            args = [self.cast(a, self.dtype) for a in args]
            kwargs = {k: self.cast(v, self.dtype) for k, v in kwargs.items()}
        elif self.dtype is not None and func in self.FP32:
            args = [self.cast(a, torch.float32) for a in args]
        return func(*args, **kwargs)


class FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        if q.dim() == 4:  # fused kernels write (batch, seq, heads, dim): transpose(1, 2) of it is free
            b, h, t, _ = q.shape
            out = torch.empty(b, t, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
        else:
            out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the planner only measures what forward saves
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@dataclass
class Saved:
    total: int = 0                                        # bytes saved for backward, each storage once
    inside: dict[str, int] = field(default_factory=dict)  # of which saved inside each chosen module
    inputs: dict[str, int] = field(default_factory=dict)  # bytes of each chosen module's tensor inputs


def measure_saved(model: nn.Module, objective, batch: dict, dtype: torch.dtype | None,
                  chosen: list[str]) -> Saved:
    """Run ``objective(model, batch)`` on the meta device and sum what autograd saves."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved, seen, stack, hooks = Saved(), set(), [], []
    mode = MetaAutocast(dtype)
    modules = dict(model.named_modules())
    for name in chosen:
        def pre(mod, args, name=name):
            stack.append(name)
            saved.inputs[name] = sum(nbytes(a) for a in args if torch.is_tensor(a))
        hooks.append(modules[name].register_forward_pre_hook(pre))
        hooks.append(modules[name].register_forward_hook(lambda *_: stack.pop() and None))

    def pack(t):
        key = t.untyped_storage()._cdata
        copies = {c.untyped_storage()._cdata for c in mode.copies.values()}
        if key not in seen and key not in params and key not in copies:
            seen.add(key)
            size = t.untyped_storage().nbytes()
            saved.total += size
            if stack:
                saved.inside[stack[0]] = saved.inside.get(stack[0], 0) + size
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            objective(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return saved


@dataclass
class Activations:
    """Bytes saved for backward: ``fixed + per_sample x micro_batch``."""
    fixed: int
    per_sample: int

    def at(self, micro_batch: int) -> int:
        return self.fixed + self.per_sample * micro_batch


def meta_batch(objective, size: int, seq_len: int) -> dict:
    ids = torch.zeros(size, seq_len, dtype=torch.long, device="meta")
    labels = torch.zeros(size, dtype=torch.long, device="meta") if isinstance(objective, SequenceCrossEntropy) \
        else torch.zeros(size, seq_len, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": labels}


def activation_estimates(model: nn.Module, objective, seq_len: int, dtype: torch.dtype | None,
                         checkpointing: Checkpointing) -> tuple[Activations, Activations, list[str]]:
    """Without and with checkpointing (the configured strategy, or every transformer block).
    Checkpointed: what is saved outside the chosen modules, plus their inputs (kept for the
    recomputation), plus one chosen module's own activations (recomputed one at a time)."""
    if not isinstance(checkpointing, ActivationCheckpointing):
        checkpointing = default_checkpointing()
    try:
        chosen = [name for name, _ in checkpointing.chosen(model)]
    except Exception:  # noqa: BLE001
        chosen = []
    runs = [measure_saved(model, objective, meta_batch(objective, b, seq_len), dtype, chosen) for b in (1, 2)]
    plain = [r.total for r in runs]
    ckpt = [r.total - sum(r.inside.values()) + sum(r.inputs.values()) + max(r.inside.values(), default=0)
            for r in runs]
    line = lambda a: Activations(2 * a[0] - a[1], a[1] - a[0])  # noqa: E731
    return line(plain), line(ckpt), chosen


def default_checkpointing() -> ActivationCheckpointing:
    """``+checkpointing=blocks`` as its file says (read as plain YAML)."""
    from importlib import resources

    import yaml
    node = yaml.safe_load((resources.files("looplib.conf") / "checkpointing" / "blocks.yaml").read_text())
    return ActivationCheckpointing(types=list(node["types"]), names=node["names"], every=node["every"])
