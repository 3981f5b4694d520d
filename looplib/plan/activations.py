"""Activations saved for backward, estimated by running the model on the meta device (no memory,
no compute), with attention counted as a fused kernel saves it (q, k, v, output, logsumexp),
for each activation strategy: none, blocks (recompute), selective (keep matmul and attention
outputs, recompute the rest) and offload (to host memory)."""
from __future__ import annotations

import copy

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..activations import SAVE, ActivationCheckpointing, Checkpointing
from ..loss import SequenceCrossEntropy


class MetaAutocast(TorchFunctionMode):
    """On meta tensors, do what autocast and a fused attention kernel would: matmuls in
    ``dtype`` (each parameter cast once), norms / softmax / losses in fp32, and scaled dot-
    product attention saving q, k, v, its output and the fp32 logsumexp (not the T x T matrix)."""

    LOW = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm, torch.addmm}
    FP32 = {F.layer_norm, F.softmax, F.log_softmax, F.cross_entropy, F.group_norm, torch.Tensor.softmax}

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype, self.copies = dtype, {}
        self.on_attention = None   # called with a fused attention's outputs (selective keeps them)
        self.loss_backward = 0     # bytes the loss's backward allocates at once (cross-entropy: see below)

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
            out = FusedAttention.apply(q, k, v)
            if self.on_attention is not None:
                self.on_attention(out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
            return out
        if self.dtype is not None and func in self.LOW:
            args = [self.cast(a, self.dtype) for a in args]
            kwargs = {k: self.cast(v, self.dtype) for k, v in kwargs.items()}
        elif self.dtype is not None and func in self.FP32:
            args = [self.cast(a, torch.float32) for a in args]
        if func is F.cross_entropy and args and torch.is_tensor(args[0]):
            # its backward, the first of the step, runs while everything saved is still held:
            # nll_loss's backward makes a gradient the size of the log-softmax output (the
            # input's shape and dtype: fp32 logits under autocast too) and log-softmax's
            # backward another, both alive at once (then the upcast's gradient in the logits'
            # dtype beside the first: less). Tokens x vocabulary: GBs for a language model.
            self.loss_backward = max(self.loss_backward, 2 * args[0].numel() * args[0].element_size())
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
    """What a meta-device forward saves for backward, each storage once (``key -> (bytes, owner)``:
    the chosen module it was saved, kept or taken in, None outside every chosen one)."""
    saved: dict = field(default_factory=dict)   # by autograd (parameters and autocast's weight copies not counted)
    inputs: dict = field(default_factory=dict)  # the chosen modules' tensor inputs (what recomputation starts from)
    kept: dict = field(default_factory=dict)    # outputs of the ops selective checkpointing keeps (in chosen modules)
    held: list = field(default_factory=list)    # every tensor noted, alive until the end: no address is reused
    loss_backward: int = 0                      # bytes the loss's backward allocates at once, beside all saved

    def note(self, what: str, t: torch.Tensor, owner: str | None) -> None:
        getattr(self, what).setdefault(t.untyped_storage()._cdata, (t.untyped_storage().nbytes(), owner))
        self.held.append(t)

    @property
    def total(self) -> int:
        return sum(size for size, _ in self.saved.values())

    @property
    def inside(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for size, owner in self.saved.values():
            if owner is not None:
                out[owner] = out.get(owner, 0) + size
        return out


class KeptOutputs(TorchDispatchMode):
    """Records the outputs of the ops in ``keep`` (aten names) run inside a chosen module."""

    def __init__(self, keep: frozenset[str], stack: list, saved: Saved):
        super().__init__()
        self.keep, self.stack, self.saved = keep, stack, saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stack and getattr(getattr(func, "overloadpacket", None), "__name__", None) in self.keep:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if torch.is_tensor(t):
                    self.saved.note("kept", t, self.stack[0])
        return out


def measure_saved(model: nn.Module, objective, batch: dict, dtype: torch.dtype | None,
                  chosen: list[str], keep: Sequence[str] = ()) -> Saved:
    """Run ``objective(model, batch)`` on the meta device and record what autograd saves, what the
    chosen modules take in, and (``keep``: aten op names) what selective checkpointing would keep."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved, stack, hooks = Saved(), [], []
    mode = MetaAutocast(dtype)
    keep = frozenset(keep)
    if any("attention" in op for op in keep):  # a fused kernel's outputs: out and logsumexp
        mode.on_attention = lambda *outs: [saved.note("kept", t, stack[0]) for t in outs] if stack else None
    modules = dict(model.named_modules())
    for name in chosen:
        def pre(mod, args, name=name):
            stack.append(name)
            for a in args:
                if torch.is_tensor(a):
                    saved.note("inputs", a, name)
        hooks.append(modules[name].register_forward_pre_hook(pre))
        hooks.append(modules[name].register_forward_hook(lambda *_: stack.pop() and None))

    def pack(t):
        key = t.untyped_storage()._cdata
        copies = {c.untyped_storage()._cdata for c in mode.copies.values()}
        if key not in params and key not in copies:
            saved.note("saved", t, stack[0] if stack else None)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode, KeptOutputs(keep, stack, saved):
            objective(model, batch)
    finally:
        for h in hooks:
            h.remove()
    saved.loss_backward = mode.loss_backward
    return saved


@dataclass
class Activations:
    """Bytes saved for backward: ``fixed + per_sample x micro_batch``."""
    fixed: int
    per_sample: int

    def at(self, micro_batch: int) -> int:
        return self.fixed + self.per_sample * micro_batch

    @staticmethod
    def line(at_1: int, at_2: int) -> "Activations":
        return Activations(2 * at_1 - at_2, at_2 - at_1)


@dataclass
class ActivationUse:
    """One activation strategy's memory, each a line in the micro-batch: ``device`` held on the
    device from the end of forward into backward, ``transient`` more on the device during
    backward at most (one block recomputed, or brought back from the host), ``host`` in host
    memory (offload). ``at`` (and ``fixed``, ``per_sample``) is the device's share of the peak."""
    device: Activations
    transient: Activations = field(default_factory=lambda: Activations(0, 0))
    host: Activations = field(default_factory=lambda: Activations(0, 0))

    def at(self, micro_batch: int) -> int:
        return self.device.at(micro_batch) + self.transient.at(micro_batch)

    @property
    def fixed(self) -> int:
        return self.device.fixed + self.transient.fixed

    @property
    def per_sample(self) -> int:
        return self.device.per_sample + self.transient.per_sample


STRATEGIES = ("none", "blocks", "selective", "offload")


def strategy_bytes(s: Saved) -> dict[str, tuple[int, int, int]]:
    """(device, transient, host) bytes of each activation strategy, from one measured forward.
    The transient is the most the backward allocates beyond what is held: one chosen module's
    saved tensors (recomputed, or brought back from the host), or the loss's backward (at its
    start, with everything held; for a language model, logits-sized gradients), whichever is more."""
    outside = {k: size for k, (size, owner) in s.saved.items() if owner is None}
    inputs = {k: size for k, (size, _) in s.inputs.items()}
    kept = {k: size for k, (size, _) in s.kept.items()}
    inside = s.inside
    recomputed: dict[str, int] = {}  # what selective recomputes in each module: saved there, not kept
    for k, (size, owner) in s.saved.items():
        if owner is not None and k not in kept:
            recomputed[owner] = recomputed.get(owner, 0) + size
    largest = max((size for size, owner in s.saved.values() if owner is not None), default=0)
    loss = s.loss_backward
    return {"none": (s.total, loss, 0),
            "blocks": (sum({**outside, **inputs}.values()), max(*inside.values(), 0, loss), 0),
            "selective": (sum({**outside, **inputs, **kept}.values()), max(*recomputed.values(), 0, loss), 0),
            "offload": (sum(outside.values()), max(largest, loss), sum(inside.values()))}


def activation_uses(model: nn.Module, objective, seq_len: int, dtype: torch.dtype | None,
                    chosen: list[str], keep: Sequence[str]) -> dict[str, ActivationUse]:
    """Every strategy's ``ActivationUse`` on the chosen modules: two meta-device forwards (micro-batch 1 and 2).
    A preference objective's sample is a pair (two sequences): its policy forward is measured (the
    reference's forward saves nothing for backward); so is a distillation's student (the teacher's
    neither: the chunked loss keeps the student's gradients, whose sizes the teacher does not change)."""
    measured = objective
    if hasattr(objective, "unread"):  # loss=distill: the student stands in for the teacher (on the meta device);
        measured = copy.copy(objective)  # its forward runs without gradients: nothing of it is saved for backward
        measured.teacher, measured.tallies = model, {True: None, False: None}
    if getattr(objective, "pairs", False):
        measured = lambda model, batch: objective.logps(model, batch)[0].sum()  # noqa: E731
    runs = [strategy_bytes(measure_saved(model, measured, meta_batch(objective, b, seq_len), dtype, chosen, keep))
            for b in (1, 2)]
    return {name: ActivationUse(*(Activations.line(runs[0][name][i], runs[1][name][i]) for i in range(3)))
            for name in STRATEGIES}


def meta_batch(objective, size: int, seq_len: int) -> dict:
    if getattr(objective, "pairs", False):  # ``size`` pairs: the chosen sequences, then the rejected ones
        ids = torch.zeros(2 * size, seq_len, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids, "chosen": torch.arange(2 * size) < size}
    ids = torch.zeros(size, seq_len, dtype=torch.long, device="meta")
    labels = torch.zeros(size, dtype=torch.long, device="meta") if isinstance(objective, SequenceCrossEntropy) \
        else torch.zeros(size, seq_len, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": labels}


def chosen_modules(model: nn.Module, checkpointing: Checkpointing) -> tuple[list[str], tuple[str, ...], str]:
    """The modules the strategy works on (the configured one, or every transformer block when
    none is: what ``+checkpointing=blocks`` would choose), the ops selective checkpointing keeps,
    and the strategy's kind (``none``, ``blocks``, ``selective``, ``offload``)."""
    kind = getattr(checkpointing, "kind", "blocks")
    strategy = checkpointing if isinstance(checkpointing, ActivationCheckpointing) else default_checkpointing()
    try:
        chosen = [name for name, _ in strategy.chosen(model)]
    except Exception:  # noqa: BLE001
        chosen = []
    return chosen, tuple(getattr(checkpointing, "save", SAVE)), kind


def activation_estimates(model: nn.Module, objective, seq_len: int, dtype: torch.dtype | None,
                         checkpointing: Checkpointing) -> tuple[ActivationUse, ActivationUse, list[str]]:
    """Without checkpointing, and with the configured strategy (every transformer block
    recomputed when none is configured), and the modules chosen."""
    chosen, keep, kind = chosen_modules(model, checkpointing)
    uses = activation_uses(model, objective, seq_len, dtype, chosen, keep)
    return uses["none"], uses["blocks" if kind == "none" else kind], chosen


def default_checkpointing() -> ActivationCheckpointing:
    """``+checkpointing=blocks`` as its file says (read as plain YAML)."""
    from importlib import resources

    import yaml
    node = yaml.safe_load((resources.files("looplib.conf") / "checkpointing" / "blocks.yaml").read_text())
    return ActivationCheckpointing(types=list(node["types"]), names=node["names"], every=node["every"])
