"""Memory planner: ``python -m looplib.plan [--world-size N] [--memory-gib G] <train overrides>``.

Prints, for the job ``python -m looplib.train <overrides>`` would run, where the memory goes
(the anatomy of the single-GPU guides), in bytes:

- static, exact (equal to the bytes of the real tensors; ``tests/test_plan.py`` checks it):
  weights, the 16-bit copies autocast makes of matmul weights under mixed precision (so
  4 bytes/param in fp32, about 6 mixed), gradients, optimizer state;
- activations saved for backward per micro-batch, with and without activation
  checkpointing: an estimate, measured by running the model on the meta device (no memory,
  no compute) with attention counted as a fused kernel saves it (q, k, v, output, logsumexp);
- per rank under DeepSpeed ZeRO 1/2/3, with and without offload, and under FSDP2 (shards plus
  the largest unit gathered whole), for ``--world-size`` ranks;

then compares with the device's memory and recommends what to change, in the guides' order.
The model is built on the meta device, so a model larger than the machine can be planned.
"""
from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.overrides import TorchFunctionMode

from . import optim as lo
from .checkpointing import ActivationCheckpointing, Checkpointing
from .loss import SequenceCrossEntropy

USABLE = 0.9  # share of device memory a plan may fill (CUDA context, allocator fragmentation)


# ------------------------------------------------------------------ static memory (exact)


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
    return sum(nbytes(p) for p in unique_params(model))


def gradient_bytes(model: nn.Module) -> int:
    """``.grad`` has the parameter's dtype and shape."""
    return sum(nbytes(p) for p in unique_params(model, trainable=True))


MATMUL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def autocast_copy_bytes(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Under autocast each parameter of a matmul module (weights and biases) is cast once per
    forward to ``dtype`` and the copy is kept for backward: the mixed-precision "+2 bytes"."""
    if dtype is None:
        return 0
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, MATMUL_MODULES):
            for p in module.parameters(recurse=False):
                seen[id(p)] = p
    return sum(p.numel() * dtype.itemsize for p in seen.values() if p.is_floating_point())


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


# ------------------------------------------------------------------ activations (estimate)


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
    from importlib import resources

    from omegaconf import OmegaConf
    node = OmegaConf.load(resources.files("looplib.conf") / "checkpointing" / "blocks.yaml")
    return ActivationCheckpointing(types=list(node.types), names=node.names, every=node.every)


# ------------------------------------------------------------------ ZeRO (DeepSpeed's layout)


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


# ------------------------------------------------------------------ the plan


@dataclass
class Plan:
    model_name: str
    n_params: int
    precision: str
    optimizer: str
    micro_batch: int | str
    accum_steps: int
    global_batch: int | None
    weights: int
    copies: int
    gradients: int
    optim_state: int
    act_plain: Activations
    act_ckpt: Activations
    checkpointing_on: bool
    chosen: list[str]
    memory: int
    memory_name: str
    world: int
    adam8bit_state: int | None = None
    act_plain_bf16: Activations | None = None
    fsdp_unit: tuple[str, int] = ("the root", 0)   # the largest unit FSDP gathers: (name, bytes)

    def fsdp(self, offload: bool = False) -> int:
        """Per rank under FSDP2: fp32 parameters, gradients and optimizer state sharded (the
        16-bit copies exist only for the gathered unit)."""
        return fsdp_per_rank(self.weights + self.gradients + self.optim_state, self.fsdp_unit[1], self.world, offload)

    @property
    def static(self) -> int:
        return self.weights + self.copies + self.gradients + self.optim_state

    @property
    def activations(self) -> Activations:
        return self.act_ckpt if self.checkpointing_on else self.act_plain

    def peak(self, micro_batch: int) -> int:
        """The step's peak. The loop frees gradients after each update (set_to_none), so without
        accumulation a forward pass ends with none allocated: activations (end of forward) and
        gradients (end of backward) take turns on top of weights, 16-bit copies and optimizer
        state. With accumulation the gradients live through the later forward passes too.
        (On an H100, bert_large: within 2% of the allocator's peak in every row of the guides'
        table; static + activations overestimated batch-4 rows by 18-28%.)"""
        held, act = self.weights + self.copies + self.optim_state, self.activations.at(micro_batch)
        return held + (self.gradients + act if self.accum_steps > 1 else max(self.gradients, act))

    def zero_layout(self) -> tuple[int, int, int]:
        """DeepSpeed's model state: 16-bit params and grads with an fp32 master copy in the
        optimizer when mixed, fp32 params and grads otherwise."""
        if self.copies:
            return 2 * self.n_params, 2 * self.n_params, 4 * self.n_params + self.optim_state
        return self.weights, self.gradients, self.optim_state


def build_plan(cfg: DictConfig, world: int = 1, memory: int | None = None) -> Plan:
    from .build import check_config, instantiate
    from .engines.local import resolve_device

    settings = check_config(cfg)
    precision = instantiate(cfg, "precision")
    factory = instantiate(cfg, "optim")
    checkpointing = instantiate(cfg, "checkpointing")
    objective = instantiate(cfg, "loss")
    with torch.device("meta"):
        model = instantiate(cfg, "model")
    dtype = getattr(precision, "dtype", None)
    seq_len = getattr(model, "seq_len", None) or cfg.data.get("seq_len")
    plain, ckpt, chosen = activation_estimates(model, objective, int(seq_len), dtype, checkpointing)
    device = resolve_device(settings.device)
    if memory is None:
        memory, name = device_memory(device)
    else:
        name = "given"
    n = sum(p.numel() for p in unique_params(model, trainable=True))
    plan = Plan(type(model).__name__, n, getattr(precision, "name", type(precision).__name__),
                type(factory).__name__, settings.batch_size, settings.accum_steps, settings.global_batch_size,
                weight_bytes(model), autocast_copy_bytes(model, dtype), gradient_bytes(model),
                optimizer_state_bytes_of(factory, model), plain, ckpt,
                isinstance(checkpointing, ActivationCheckpointing), chosen, memory, name, world)
    from .engines.fsdp import BLOCKS
    blocks = cfg.engine.get("blocks", BLOCKS) if cfg.get("engine") is not None else BLOCKS
    name, count = max(fsdp_units(model, blocks or BLOCKS), key=lambda u: u[1])
    plan.fsdp_unit = (name, count * (2 if dtype in (torch.bfloat16, torch.float16) else 4))
    if not isinstance(factory, lo.Adam8bit):
        plan.adam8bit_state = adam8bit_rule(model)
    if dtype is None:
        plan.act_plain_bf16 = activation_estimates(model, objective, int(seq_len), torch.bfloat16, checkpointing)[0]
    return plan


def adam8bit_rule(model: nn.Module) -> int:
    factory = object.__new__(lo.Adam8bit)  # settings only: no bitsandbytes import for a what-if
    factory.min_8bit_size, factory.embeddings_32bit = 4096, True
    return _adam8bit(factory, model)


def device_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, props.name
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


# ------------------------------------------------------------------ printing


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def row(label: str, value: int) -> str:
    return f"  {label:<62} {value:>18,} B  {human(value):>11}"


def largest_micro_batch(budget: int, act: Activations, cap: int | None = None) -> int:
    """The largest micro-batch whose activations fit in ``budget`` (a multiple of 8 from 8 up)."""
    if act.per_sample <= 0:
        return cap or 0
    b = max(0, (budget - act.fixed) // act.per_sample)
    if cap:
        b = min(b, cap)
    return b - b % 8 if b >= 8 else b


def recommendations(plan: Plan) -> list[str]:
    usable = int(plan.memory * USABLE)
    target = plan.global_batch or (plan.micro_batch * plan.accum_steps if isinstance(plan.micro_batch, int) else None)
    out = []
    budget = usable - plan.static
    best = largest_micro_batch(budget, plan.activations)
    if best >= 1:
        text = (f"largest micro-batch that fits at any accumulation: {best}" +
                (" (a multiple of 8)" if best >= 8 else ""))
        if target:
            from .autobatch import candidates
            eights, small = candidates(target)
            micro = max([d for d in eights if d <= best] or [d for d in small if d <= best])
            text += (f"; for the global batch of {target}: batch_size={micro} accum_steps={target // micro} "
                     f"(fill the device before accumulating; batch_size=auto global_batch_size={target} measures it)")
        out.append(text)
        if isinstance(plan.micro_batch, int):
            need = plan.peak(plan.micro_batch)
            verdict = "fits" if need <= usable else "does NOT fit"
            out.append(f"the configured micro-batch {plan.micro_batch} {verdict} ({human(need)} of {human(usable)} usable)")
        if not (isinstance(plan.micro_batch, int) and need > usable):
            return out + engine_choice(plan, usable)
    else:
        out.append(f"not even a micro-batch of 1 fits ({human(plan.static + plan.activations.at(1))} "
                   f"needed, {human(usable)} usable); in the guides' order:")
    if not plan.checkpointing_on:
        saved = plan.act_plain.at(1) - plan.act_ckpt.at(1)
        out.append(f"+checkpointing=blocks: activations per sample {human(plan.act_plain.per_sample)} -> "
                   f"{human(plan.act_ckpt.per_sample)} (saves {human(saved)} at micro-batch 1)")
    if plan.adam8bit_state is not None:
        out.append(f"+optim=adam8bit: optimizer state {human(plan.optim_state)} -> {human(plan.adam8bit_state)}")
    if plan.act_plain_bf16 is not None:
        out.append(f"+precision=bf16 (or fp16): activations per sample {human(plan.act_plain.per_sample)} -> "
                   f"{human(plan.act_plain_bf16.per_sample)}, at the cost of 2 bytes/param of 16-bit weight copies")
    out += engine_choice(plan, usable)
    return out


def engine_choice(plan: Plan, usable: int) -> list[str]:
    """DDP while the model state fits one device (one all-reduce per step, the least traffic);
    else the first sharding that fits, least communication first: ZeRO-1/2 (parameters whole),
    FSDP2 (everything sharded, one unit gathered at a time; about ZeRO-3's layout, PyTorch's
    own), then offload to host memory (FSDP's engine.offload=cpu, ZeRO-Offload / -Infinity)."""
    act = plan.act_ckpt.at(1)
    model_state = plan.weights + plan.gradients + min(plan.optim_state, plan.adam8bit_state or plan.optim_state)
    if model_state + act <= usable:
        return [f"engine: the model state ({human(model_state)}) fits one device: +engine=ddp over "
                f"{plan.world} rank(s) (every rank holds everything; one all-reduce per step)"] if plan.world > 1 else []
    p, g, o = plan.zero_layout()
    head = f"the model state alone ({human(model_state)}) does not fit: "
    unit = f"(shards + the largest unit, {plan.fsdp_unit[0]}, gathered)"
    for what, need in [("DeepSpeed ZeRO-1 (+engine=deepspeed engine.stage=1)", zero_per_rank(p, g, o, plan.world, 1)),
                       ("DeepSpeed ZeRO-2 (+engine=deepspeed engine.stage=2)", zero_per_rank(p, g, o, plan.world, 2)),
                       (f"+engine=fsdp {unit}", plan.fsdp()),
                       (f"+engine=fsdp engine.offload=cpu {unit}", plan.fsdp(offload=True)),
                       ("DeepSpeed ZeRO-2 with optimizer offload", zero_per_rank(p, g, o, plan.world, 2, True)),
                       ("DeepSpeed ZeRO-3 with optimizer and parameter offload",
                        zero_per_rank(p, g, o, plan.world, 3, True, True))]:
        if need + act <= usable:
            return [head + f"{what} over {plan.world} rank(s) needs {human(need)} per rank"]
    return [head + f"not even FSDP / ZeRO-3 with offload over {plan.world} rank(s) fits: use more ranks (--world-size)"]


def render(plan: Plan) -> str:
    mb = plan.micro_batch if isinstance(plan.micro_batch, int) else 1
    act = plan.activations
    lines = [f"memory plan: {plan.model_name} ({plan.n_params:,} trainable parameters), precision {plan.precision}, "
             f"optimizer {plan.optimizer}, activation checkpointing {'on' if plan.checkpointing_on else 'off'}, "
             f"micro-batch {plan.micro_batch} x accumulation {plan.accum_steps}",
             "static (exact):",
             row(f"weights ({plan.weights / max(plan.n_params, 1):.0f} bytes/param)", plan.weights),
             row("16-bit copies of matmul weights (autocast)", plan.copies),
             row("gradients", plan.gradients),
             row(f"optimizer state ({plan.optimizer})", plan.optim_state),
             row(f"static total ({plan.static / max(plan.n_params, 1):.2f} bytes/param)", plan.static),
             "activations saved for backward (estimate, meta-device run):",
             row("per sample, without checkpointing", plan.act_plain.per_sample),
             row(f"per sample, with checkpointing ({len(plan.chosen)} modules)", plan.act_ckpt.per_sample),
             row(f"micro-batch {mb}, without checkpointing", plan.act_plain.at(mb)),
             row(f"micro-batch {mb}, with checkpointing", plan.act_ckpt.at(mb)),
             row(f"peak at micro-batch {mb} x accumulation {plan.accum_steps} (as configured)", plan.peak(mb)),
             row(f"device memory ({plan.memory_name}); {USABLE:.0%} usable", plan.memory)]
    p, g, o = plan.zero_layout()
    lines.append(f"DeepSpeed ZeRO model state per rank, {plan.world} rank(s) "
                 f"(params {human(p)}, grads {human(g)}, optimizer + master {human(o)}):")
    lines.append(f"  {'stage':<10}{'on device':>20}{'optimizer offload':>20}{'+ param offload':>20}")
    for stage in (0, 1, 2, 3):
        cells = [zero_per_rank(p, g, o, plan.world, stage), zero_per_rank(p, g, o, plan.world, stage, True)]
        cells.append(zero_per_rank(p, g, o, plan.world, stage, True, True) if stage == 3 else None)
        lines.append(f"  {stage:<10}" + "".join(f"{human(c) if c is not None else '-':>20}" for c in cells))
    lines.append(f"FSDP2 (+engine=fsdp) per rank, {plan.world} rank(s): parameters, gradients and optimizer state "
                 f"/ {plan.world} + 2 x the largest unit ({plan.fsdp_unit[0]}, {human(plan.fsdp_unit[1])}) = "
                 f"{human(plan.fsdp())}; with engine.offload=cpu {human(plan.fsdp(offload=True))}")
    lines.append("recommendations:")
    lines += [f"  - {r}" for r in recommendations(plan)]
    return "\n".join(lines)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is looplib's one-line error (exit 2), not a usage screen."""

    def error(self, message: str):
        from .errors import ConfigError
        flag = message.split("argument ")[-1].split(":")[0] if "argument " in message else "arguments"
        raise ConfigError(flag.split("/")[0], " ".join(message.split()), "see python -m looplib.plan --help")


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .errors import EXIT_CONFIG, ConfigError

    parser = OneLineParser(prog="python -m looplib.plan", description=__doc__.split("\n\n")[0],
                           epilog="Other arguments are the overrides `python -m looplib.train` takes.")
    parser.add_argument("--world-size", type=int, default=1, help="ranks for the ZeRO rows (default 1)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="device memory to plan for (default: this machine's GPU, else its RAM)")
    try:
        args, overrides = parser.parse_known_args(argv)
        if args.world_size < 1:
            raise ConfigError("--world-size", f"must be at least 1 (got {args.world_size})", "use e.g. --world-size 8")
        if args.memory_gib is not None and not (math.isfinite(args.memory_gib) and args.memory_gib > 0):
            raise ConfigError("--memory-gib", f"must be a positive number of GiB (got {args.memory_gib})",
                              "use e.g. --memory-gib 80, or leave it out to plan for this machine")
        flags = [o for o in overrides if o.startswith("-")]
        if flags:
            raise ConfigError(flags[0], "is not an option of python -m looplib.plan",
                              "use --world-size N, --memory-gib G, and python -m looplib.train's overrides")
        with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        memory = int(args.memory_gib * 2**30) if args.memory_gib is not None else None
        print(render(build_plan(cfg, args.world_size, memory)))
    except ConfigError as err:
        print(f"looplib: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except (HydraException, OmegaConfBaseException) as err:
        print(f"looplib: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
