"""Muon for the hidden matrices, AdamW for everything else: ``+optim=muon`` (``conf/optim/muon.yaml``).

Muon (``torch.optim.Muon``, torch >= 2.9) keeps one momentum buffer per matrix and replaces each
update by the nearest semi-orthogonal matrix (five Newton-Schulz iterations in bf16). It is
defined for the 2-D weights of the hidden layers only: here, the 2-D weights inside the model's
*repeated blocks*. Everything else (embeddings, the output head, norms, biases, a classifier, a
pooler) goes to AdamW with looplib's usual grouping (biases, norms and embeddings never decay).

- **The blocks** are found from the model's structure: the children of every ``nn.ModuleList``
  whose members are all of one class and have sub-modules (the bundled GPT's ``blocks``, a
  transformers model's ``layers`` / ``h`` / ``layer``). ``optim.blocks=[ClassName]`` names them
  instead (any module whose class, or a base class, has that name).
- **One optimizer object** (``MuonAdamW``): its first param group is Muon's (``use_muon: True``),
  the others are AdamW's. The loop, the schedule (it scales every group's lr, so both families
  follow it), gradient clipping, fp16's scaler and checkpoints see one ``torch.optim.Optimizer``;
  ``state_dict()`` is the usual one (``momentum_buffer`` per Muon parameter; AdamW's ``step``,
  ``exp_avg``, ``exp_avg_sq`` for the rest) and round-trips.
- **The update** is ``torch.optim.Muon``'s, step for step (its Newton-Schulz and lr adjustment are
  torch's own functions): equal bit for bit to ``torch.optim.Muon`` + ``torch.optim.AdamW`` on
  the same split (tests/unit/test_muon.py).
- **Sharded (FSDP2)**: a Muon parameter is a row-sharded ``DTensor``, and Newton-Schulz needs the
  whole matrix. The momentum update runs on each rank's rows; the update matrix is then
  all-gathered (one matrix at a time), every rank orthogonalises the whole matrix (the same
  inputs, the same result) and keeps its own rows. Two processes equal one to float rounding.
"""
from __future__ import annotations

from typing import Annotated, Literal

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from .errors import ConfigError
from .optim import BETAS, EPS, LR, WEIGHT_DECAY, OptimizerFactory, param_groups
from .schema import Beta, NonNegative, Positive, Range

# torch.optim.Muon's defaults (torch 2.13): Keller Jordan's quintic coefficients, five iterations
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
MOMENTUM = 0.95
# The update's scale: "match_rms_adamw" (Moonshot's 0.2 * sqrt(max(rows, cols))) gives Muon's
# update the RMS of an AdamW update, so Muon takes AdamW's learning rate and weight decay;
# "original" (Keller Jordan's sqrt(max(1, rows / cols))) wants an lr about 10x larger (0.02).
ADJUST_LR = "match_rms_adamw"


def repeated_blocks(model: nn.Module, names: list[str] | None = None) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class (or a base class) is named in ``names``,
    or, without names, the members of every ``nn.ModuleList`` whose members are all of one class
    and are themselves made of modules (a list of bare ``Linear`` heads is not a stack of blocks)."""
    if names:
        wanted = set(names)
        return [m for m in model.modules() if any(c.__name__ in wanted for c in type(m).__mro__)]
    found = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1 \
                and any(True for _ in module[0].children()):
            found.extend(module)
    return found


def hidden_matrices(model: nn.Module, names: list[str] | None = None) -> list[nn.Parameter]:
    """The parameters Muon takes, in ``model.parameters()`` order: trainable 2-D weights owned by
    modules inside the repeated blocks, except embeddings and any weight also used outside them
    (tied)."""
    inside: set[int] = set()
    for block in repeated_blocks(model, names):
        inside.update(id(m) for m in block.modules())
    candidates, outside = set(), set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(module) not in inside:
                outside.add(id(p))
            elif p.ndim == 2 and p.requires_grad and not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                candidates.add(id(p))
    return [p for p in model.parameters() if id(p) in candidates and id(p) not in outside]


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer for the loop: ``torch.optim.Muon``'s update on the param groups marked
    ``use_muon``, ``torch.optim.AdamW`` (an inner instance sharing these groups and this state) on
    the others. Groups carry their own lr and weight decay, so a schedule scales both families."""

    def __init__(self, groups: list[dict], foreach: bool | None = None, fused: bool | None = None):
        muon = [g for g in groups if g.get("use_muon")]
        adam = [dict(g, use_muon=False) for g in groups if not g.get("use_muon")]
        for g in muon:
            for p in g["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, not one of shape {tuple(p.shape)}")
        # AdamW fills its defaults (betas, eps, amsgrad, ...) into its groups: the same dicts are ours
        self.adamw = torch.optim.AdamW(adam, foreach=foreach, fused=fused) if adam else None
        super().__init__([*muon, *(self.adamw.param_groups if adam else [])], defaults={})
        self._link()

    def _link(self) -> None:
        """The inner AdamW steps our AdamW groups and keeps its state in ours (again after a load,
        which replaces the group dicts and the state)."""
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_update(p, group)
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        """``torch.optim.Muon``'s update of one matrix (torch 2.13, ``_single_tensor_muon``), on
        the rank's own rows when ``p`` is a sharded DTensor (FSDP2), Newton-Schulz on the whole."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        grad, buf, weight = local(p.grad), local(state["momentum_buffer"]), local(p)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        if weight is not p:  # a shard: gather the whole matrix, orthogonalise it, keep our rows
            update = whole(update, p)
        update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
        if weight is not p:
            update = own_rows(update, p)
        lr = group["lr"]
        adjusted = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)  # p.shape: the whole matrix's, sharded or not
        weight.mul_(1 - lr * group["weight_decay"])
        weight.add_(update, alpha=-adjusted)


NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(update: torch.Tensor, coefficients, steps: int, eps: float, dtype: str) -> torch.Tensor:
    """The orthogonalised ``update``: torch's own iteration (bf16, as ``torch.optim.Muon``), or the
    same quintic iteration in fp32 (``optim.ns_dtype=fp32``: slower on a GPU, but a last-bit
    difference in the gradient stays a last-bit difference instead of a bf16 rounding)."""
    if dtype == "bf16":
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    a, b, c = coefficients
    x = update.to(NS_DTYPES[dtype])
    wide = x.T if x.size(0) > x.size(1) else x  # iterate on the side with fewer rows: a smaller Gram matrix
    wide = wide / wide.norm().clamp(min=eps)
    for _ in range(steps):
        gram = wide @ wide.T
        wide = a * wide + (b * gram + c * gram @ gram) @ wide
    return wide.T if x.size(0) > x.size(1) else wide


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (a view: in-place changes reach the parameter), or ``t`` itself."""
    return t.to_local() if hasattr(t, "device_mesh") else t


def whole(shard: torch.Tensor, like) -> torch.Tensor:
    """The whole matrix from every rank's rows (an all-gather), laid out as ``like`` (a DTensor)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(shard, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride()).full_tensor()


def own_rows(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's part of ``full`` as ``like`` (a DTensor) is sharded: every rank holds ``full``,
    so nothing is sent (``src_data_rank=None``)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


class Muon(OptimizerFactory):
    """``+optim=muon``: ``torch.optim.Muon`` on the hidden matrices, ``torch.optim.AdamW`` on the rest.

    lr / weight_decay: Muon's (with ``adjust_lr=match_rms_adamw`` on AdamW's scale). momentum,
    nesterov, ns_steps, ns_coefficients, eps: Muon's momentum and Newton-Schulz iteration
    (torch's defaults); ns_dtype: bf16 (torch's) or fp32. adjust_lr: ``match_rms_adamw`` or ``original`` (torch's ``adjust_lr_fn``).
    adam_lr / adam_weight_decay (None: Muon's), adam_betas, adam_eps: the AdamW family's
    (embeddings, head, norms, biases; biases, norms and embeddings never decay). blocks: class
    names of the repeated blocks (None: found from the model's structure).
    """

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY,
                 momentum: Beta = MOMENTUM, nesterov: bool = True,
                 ns_steps: Annotated[int, Range(ge=1, le=99)] = NS_STEPS,
                 adjust_lr: Literal["original", "match_rms_adamw"] = ADJUST_LR,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: Positive[float] = NS_EPS,
                 adam_lr: Positive[float] | None = None, adam_weight_decay: NonNegative[float] | None = None,
                 adam_betas: tuple[Beta, Beta] = BETAS, adam_eps: Positive[float] = EPS,
                 ns_dtype: Literal["bf16", "fp32"] = "bf16", blocks: list[str] | None = None):
        super().__init__(lr, weight_decay)
        if adjust_lr not in ("original", "match_rms_adamw"):
            raise ConfigError("optim.adjust_lr", f"{adjust_lr!r} is not a learning-rate adjustment",
                              "use optim.adjust_lr=match_rms_adamw or original")
        if not 1 <= ns_steps <= 99:
            raise ConfigError("optim.ns_steps", f"optim.ns_steps must be >= 1 and <= 99 (got optim.ns_steps={ns_steps})",
                              "use e.g. optim.ns_steps=5 (the default)")
        if nesterov and momentum == 0:
            raise ConfigError("optim.nesterov", "Nesterov momentum needs a momentum (got momentum=0)",
                              "set optim.momentum above 0, or optim.nesterov=false")
        self.momentum, self.nesterov, self.ns_steps, self.adjust_lr = momentum, nesterov, ns_steps, adjust_lr
        if ns_dtype not in NS_DTYPES:
            raise ConfigError("optim.ns_dtype", f"{ns_dtype!r} is not a Newton-Schulz dtype", "use optim.ns_dtype=bf16 or fp32")
        self.ns_coefficients, self.eps, self.ns_dtype = tuple(ns_coefficients), eps, ns_dtype
        self.adam_lr = lr if adam_lr is None else adam_lr
        self.adam_weight_decay = weight_decay if adam_weight_decay is None else adam_weight_decay
        self.adam_betas, self.adam_eps = tuple(adam_betas), adam_eps
        self.blocks = None if blocks is None else list(blocks)

    builds = MuonAdamW  # what build() makes (engines ask without a model: looplib.optim.built_class)
    gathers_matrices = True  # sharded (FSDP2): each matrix's update is all-gathered for Newton-Schulz

    def check(self, engine, peft) -> None:
        """Build time: an adapter trains low-rank factors, not the hidden matrices Muon is for."""
        from .peft import LoRA
        if isinstance(peft, LoRA):
            raise ConfigError("optim", f"+optim=muon with +peft={type(peft).__name__.lower()}: Muon orthogonalises "
                              "whole weight matrices, and an adapter trains low-rank factors of a frozen base "
                              "(not what Muon's update is defined or tuned for)",
                              "use +optim=adamw with LoRA/QLoRA, or train the whole model with +optim=muon")

    def groups(self, model: nn.Module) -> list[dict]:
        """Muon's group (the hidden matrices) first, then AdamW's (looplib's decay / no-decay split)."""
        matrices = hidden_matrices(model, self.blocks)
        if not matrices:
            where = f"modules of class {', '.join(self.blocks)}" if self.blocks else \
                "repeated blocks (an nn.ModuleList of one block class)"
            raise ConfigError("optim.blocks", f"+optim=muon found no trainable 2-D weight in {where} of "
                              f"{type(model).__name__}, so Muon would train nothing",
                              "name the block class, e.g. optim.blocks=[DecoderLayer], or use +optim=adamw")
        chosen = {id(p) for p in matrices}
        muon = {"params": matrices, "use_muon": True, "lr": self.lr, "weight_decay": self.weight_decay,
                "momentum": self.momentum, "nesterov": self.nesterov, "ns_coefficients": self.ns_coefficients,
                "eps": self.eps, "ns_steps": self.ns_steps, "adjust_lr_fn": self.adjust_lr, "ns_dtype": self.ns_dtype}
        adam = []
        for g in param_groups(model, self.adam_weight_decay):
            rest = [p for p in g["params"] if id(p) not in chosen]
            if rest:
                adam.append({**g, "params": rest, "use_muon": False, "lr": self.adam_lr,
                             "betas": self.adam_betas, "eps": self.adam_eps})
        return [muon, *adam]

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.create(self.groups(model))

    def create(self, groups: list[dict]) -> torch.optim.Optimizer:
        """``groups``: as ``groups(model)`` makes them (each marked ``use_muon``)."""
        on_cuda = all(p.is_cuda for g in groups for p in g["params"])
        return MuonAdamW(groups, foreach=None if on_cuda else True, fused=True if on_cuda else None)
