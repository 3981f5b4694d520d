"""A model's linear layers in 4 bits (``+peft=qlora``, ``looplib.peft.QLoRA``): bitsandbytes'
``Linear4bit`` in place of every ``nn.Linear`` but the output layer, back to full precision for
an export, and the bytes they take (``looplib.plan``).

On the meta device (the planner: no memory, no kernels) a layer becomes ``PlannedLinear4bit``:
its weight is marked with the 4-bit layout it would take, and its forward saves what
bitsandbytes' saves for backward (no activation: only the packed weight, a parameter).
bitsandbytes itself is imported only when a real model is quantised.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from .errors import ConfigError

log = logging.getLogger("looplib")

BLOCK = 64        # weights per quantisation block (bitsandbytes' default): one absmax each
NESTED_BLOCK = 256  # absmax values per block of the double quantisation: one fp32 scale each


def output_layer(model: nn.Module) -> nn.Module | None:
    """The layer that makes the logits (kept in full precision, as transformers does)."""
    for owner in (model, getattr(model, "hf", None)):
        get = getattr(owner, "get_output_embeddings", None)
        if callable(get) and get() is not None:
            return get()
    return getattr(model, "lm_head", None)


def quantisable(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every plain ``nn.Linear`` but the output layer and layers whose weight another module shares."""
    head = output_layer(model)
    counts: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m is not head and counts[id(m.weight)] == 1]


def is_4bit(module: nn.Module, planned: bool = True) -> bool:
    """bitsandbytes' ``Linear4bit`` (not peft's LoRA layer of the same name around it), or with
    ``planned`` the planner's stand-in."""
    cls = type(module)
    return (cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")) or \
        (planned and cls is PlannedLinear4bit)


def quantize(model: nn.Module, bnb, quant_type: str, double_quant: bool, compute_dtype: torch.dtype,
             device: torch.device, storage: torch.dtype = torch.uint8, place: torch.device | None = None) -> nn.Module:
    """Replace the linear layers in place (those transformers already loaded in 4 bits stay):
    quantised on ``device``, the packed weights held in ``storage`` (uint8, or a float dtype that
    FSDP shards as it shards any parameter: two 4-bit weights a byte either way) and left on
    ``place`` (default ``device``; a sharding engine takes them from host memory one unit at a time)."""
    meta = any(p.is_meta for p in model.parameters())
    layers = quantisable(model)
    done = [m for m in model.modules() if is_4bit(m)]
    if not layers and not done:
        raise ConfigError("peft", f"{type(model).__name__} has no linear layer to quantise (besides its output layer)",
                          "use +peft=lora, or a model whose layers are nn.Linear")
    modules = dict(model.named_modules())
    for name, linear in layers:
        parent, _, attr = name.rpartition(".")
        layer = PlannedLinear4bit(linear, bnb, quant_type, double_quant, compute_dtype, device) if meta \
            else real_4bit(linear, bnb, quant_type, double_quant, compute_dtype, device, storage, place or device)
        setattr(modules[parent] if parent else model, attr, layer)
    for m in model.modules():
        if is_4bit(m, planned=False):
            # bitsandbytes repacks weights for its CPU kernel on the first forward that needs no
            # gradient (an evaluation); training after it fails (its gemv path writes into a view)
            m.support_avx512bf16_for_cpu = False
            m.compute_dtype, m.compute_type_is_set = compute_dtype, True
            if not getattr(m, "loads_quant_state", False):  # resume: the constants come back with the bytes
                m._register_load_state_dict_pre_hook(load_quant_state, with_module=True)
                m.register_forward_pre_hook(constants_follow)
                m.loads_quant_state = True
    if layers:
        log.info("QLoRA: %d linear layers of %s in 4 bits (%s%s, compute %s)", len(layers), type(model).__name__,
                 quant_type, " double-quantised" if double_quant else "", str(compute_dtype).removeprefix("torch."))
    return model


def load_quant_state(module, state_dict, prefix, *args) -> None:
    """A ``Linear4bit``'s state dict holds its quantisation constants beside the packed weight
    (``weight.absmax``, ``weight.quant_map``, ...): taken out of ``state_dict`` (torch would call
    them unexpected) and made the layer's quantisation state, so a checkpoint restores both."""
    head = prefix + "weight."
    stats = {key[len(head):]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(head)]}
    if stats:
        from bitsandbytes.functional import QuantState
        module.weight.quant_state = module.quant_state = QuantState.from_dict(stats, device=module.weight.device)


def constants_follow(module, args) -> None:
    """The quantisation constants on the device the input is on. Under FSDP the packed weight is a
    shard that FSDP moves and gathers; the constants are the module's own (``module.quant_state``,
    whole on every rank), which bitsandbytes puts back on the gathered weight in its forward."""
    qs = getattr(module, "quant_state", None)
    if qs is not None and args and torch.is_tensor(args[0]) and qs.absmax.device != args[0].device:
        qs.to(args[0].device)


def quant_constants(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every 4-bit layer's quantisation constants under the names its state dict gives them
    (``<layer>.weight.absmax`` ...; bitsandbytes' own packing), from the module's own state: under
    FSDP the weight is a shard without it. Empty for a model without 4-bit layers."""
    out = {}
    for name, m in model.named_modules():
        if is_4bit(m, planned=False) and getattr(m, "quant_state", None) is not None:
            for key, value in m.quant_state.as_dict(packed=True).items():
                out[f"{name}.weight.{key}"] = value
    return out


def restore_constants(model: nn.Module, constants: dict[str, torch.Tensor]) -> None:
    """Each 4-bit layer's quantisation state from ``constants`` (``quant_constants``' names)."""
    from bitsandbytes.functional import QuantState
    for name, m in model.named_modules():
        head = f"{name}.weight."
        stats = {key[len(head):]: value for key, value in constants.items() if key.startswith(head)}
        if stats and is_4bit(m, planned=False):
            device = m.quant_state.absmax.device
            m.quant_state = QuantState.from_dict(stats, device=device)
            if getattr(m.weight, "quant_state", None) is not None:
                m.weight.quant_state = m.quant_state


def frozen_bias(linear: nn.Linear, dtype: torch.dtype, device=None):
    # bitsandbytes casts the bias to the compute dtype at the first forward; cast it once here
    if linear.bias is None:
        return None
    return nn.Parameter(linear.bias.detach().to(device=device, dtype=dtype), requires_grad=False)


def real_4bit(linear: nn.Linear, bnb, quant_type, double_quant, compute_dtype, device, storage=torch.uint8,
              place=None) -> nn.Module:
    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type=quant_type,
                              quant_storage=storage, device="meta")
    weight = bnb.nn.Params4bit(linear.weight.detach(), requires_grad=False, compress_statistics=double_quant,
                               quant_type=quant_type, quant_storage=storage, module=layer)._quantize(device)
    place = torch.device(place or device)
    if weight.device != place:  # Params4bit.to moves its quantisation state (the module's too) with it
        weight = weight.to(place)
    layer.weight = weight
    layer.bias = frozen_bias(linear, compute_dtype, place)
    return layer


class PlannedLinear4bit(nn.Linear):
    """A ``Linear4bit`` as the planner sees it on the meta device: the weight keeps its shape
    (``fourbit`` on it says how it would be stored) and forward saves no activation."""

    def __init__(self, linear: nn.Linear, bnb, quant_type, double_quant, compute_dtype, device):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.weight.fourbit = double_quant
        self.bias = frozen_bias(linear, compute_dtype)
        self.compute_dtype = compute_dtype

    def forward(self, x):
        return MatMul4bitPlan.apply(x, self.weight, self.bias)


class MatMul4bitPlan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):  # bitsandbytes keeps the packed weight on ctx: nothing is saved
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):  # never run: the planner only measures what forward saves
        return grad.new_empty(*grad.shape[:-1], 0), None, None


def fourbit_bytes(n: int, double_quant: bool) -> int:
    """Bytes of one ``n``-weight layer in 4 bits: two weights a byte, one absmax per block of 64
    (fp32; with double quantisation uint8, plus one fp32 scale per 256 blocks, an fp32 offset and
    the 256-entry fp32 code of the scales), and the 16-entry fp32 code of the weights."""
    blocks = math.ceil(n / BLOCK)
    scales = blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 + 256 * 4 if double_quant else 4 * blocks
    return math.ceil(n / 2) + scales + 16 * 4


def quant_tensors(param) -> list[torch.Tensor]:
    """The tensors of a quantised ``Params4bit``'s quantisation state (absmax, codes, offset)."""
    qs, out = param.quant_state, []
    for t in (qs.absmax, qs.code, getattr(qs, "offset", None)):
        if torch.is_tensor(t):
            out.append(t)
    if getattr(qs, "state2", None) is not None:
        out += [t for t in (qs.state2.absmax, qs.state2.code) if torch.is_tensor(t)]
    return out


def dequantized(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (``model``'s state dict) with each 4-bit layer's weight back in full precision
    (bitsandbytes' dequantisation, in the dtype it was quantised from) and its constants dropped.
    Each layer goes to host memory as soon as it is dequantised: the full-precision base of a model
    that trained in 4 bits does not fit where it trained (an 8B base: 32 GB in fp32 beside 5 GB)."""
    layers = {f"{name}.weight": m for name, m in model.named_modules() if is_4bit(m, planned=False)}
    if not layers:
        return weights
    import bitsandbytes.functional as F
    constants = tuple(key + "." for key in layers)  # key.absmax, key.quant_map, key.nested_absmax ...
    out = {key: value for key, value in weights.items() if not key.startswith(constants)}
    for key, m in layers.items():
        if key in out:  # the packed bytes as gathered (FSDP: the weight itself is this rank's shard)
            qs = getattr(m.weight, "quant_state", None) or m.quant_state
            packed = out[key].to(qs.absmax.device)
            out[key] = F.dequantize_4bit(packed, qs).to("cpu", qs.dtype)
    return out
