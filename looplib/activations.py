"""Activation checkpointing: less activation memory for backward, three ways, on chosen submodules.

- ``+checkpointing=blocks`` (``ActivationCheckpointing``): recompute each chosen submodule's
  activations in backward (``torch.utils.checkpoint``, ``use_reentrant=False``, the variant that
  works with DDP, keyword arguments and inputs that do not require grad);
- ``+checkpointing=selective`` (``SelectiveCheckpointing``): keep the outputs of the expensive
  ops (matmuls, attention: ``save``) and recompute only the cheap ones
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``);
- ``+checkpointing=offload`` (``OffloadActivations``): keep everything, but in host memory: each
  storage saved for backward inside a chosen submodule is copied to (pinned) host memory in
  forward and back in backward (``torch.autograd.graph.saved_tensors_hooks``); on CUDA the
  copies out run on a side stream beside the forward's kernels.

Not to be confused with the saved-state checkpoints of the top-level ``checkpoint:`` settings
(saving a run to disk: ``looplib.store.saving``, ``looplib.store.checkpoint_dir``).

A wrapped submodule keeps its class, its parameters' names and its hooks: only its ``forward``
attribute is replaced (``state_dict`` keys, safetensors files and resume are unchanged).
``model.forward`` under ``torch.no_grad()`` / inference mode runs the original.
"""
from __future__ import annotations

import difflib
import functools
import logging
import re
import weakref
from typing import NamedTuple, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .errors import ConfigError
from .schema import Positive

log = logging.getLogger("looplib")


class Checkpointing:
    """No activation checkpointing: the null object (``+checkpointing=none``)."""

    kind = "none"  # how looplib.plan counts its activations: none, blocks, selective or offload

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def wrapped(self, model: nn.Module) -> list[str]:
        return []

    def check(self, engine, compile) -> None:
        """Refuse an engine or a compile mode this strategy cannot run with (build time)."""


NoCheckpointing = Checkpointing


class ActivationCheckpointing(Checkpointing):
    """Checkpoint every ``every``-th submodule whose class (or a base class) is one of ``types``
    (class names such as ``Block``, ``GPT2Block``, ``BertLayer``, transformers' base of every
    decoder/encoder layer ``GradientCheckpointingLayer``, or dotted paths) or whose qualified name
    matches the regular expression ``names`` (e.g. ``blocks\\.\\d+``). A match inside an
    already chosen submodule is skipped (checkpointing the outer one covers it)."""

    kind, what = "blocks", "activation checkpointing"

    def __init__(self, types: Sequence[str] = (), names: str | None = None, every: Positive[int] = 1):
        if not types and not names:
            raise ConfigError("checkpointing", "neither checkpointing.types nor checkpointing.names is set",
                              "name module classes (checkpointing.types=[Block]) or a name pattern")
        if every < 1:
            raise ConfigError("checkpointing.every", f"every must be at least 1 (got every={every})",
                              "use 1 to checkpoint every matching module, 2 for every other one")
        try:
            self.pattern = re.compile(names) if names else None
        except re.error as err:
            raise ConfigError("checkpointing.names", f"{names!r} is not a regular expression ({err})",
                              "use e.g. checkpointing.names='blocks\\.\\d+'") from None
        self.types, self.names, self.every = tuple(types), names, every

    def matches(self, name: str, module: nn.Module) -> bool:
        # a class or any base class: GradientCheckpointingLayer names every transformers block
        for cls in type(module).__mro__[:-1]:
            if cls.__name__ in self.types or f"{cls.__module__}.{cls.__qualname__}" in self.types:
                return True
        return bool(self.pattern and name and self.pattern.fullmatch(name))

    def chosen(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        found, inside = [], ()
        for name, module in model.named_modules():
            if inside and any(name.startswith(prefix + ".") for prefix in inside):
                continue
            if self.matches(name, module):
                found.append((name, module))
                inside = inside + (name,)
        return found[:: self.every]

    def apply(self, model: nn.Module) -> nn.Module:
        chosen = self.chosen(model)
        if not chosen:
            what = " or ".join(filter(None, [f"types={list(self.types)}" if self.types else "",
                                             f"names={self.names!r}" if self.names else ""]))
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError("checkpointing", f"no submodule of {type(model).__name__} matches {what}",
                              f"choose among its module classes: {', '.join(classes)}")
        for _, module in chosen:
            self.wrap(module)
        log.info("%s: %d of %s's submodules (%s ...)", self.what, len(chosen), type(model).__name__, chosen[0][0])
        return model

    def wrap(self, module: nn.Module) -> None:
        checkpoint_module(module)

    def wrapped(self, model: nn.Module) -> list[str]:
        return [name for name, m in model.named_modules() if is_checkpointed(m)]


# ------------------------------------------------------------------ selective


# the ops whose outputs selective checkpointing keeps: matmuls and every fused attention kernel
# (what recomputing costs most); everything else (norms, activations, adds, casts) is recomputed
SAVE = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward")


class SelectiveCheckpointing(ActivationCheckpointing):
    """Selective activation checkpointing of the chosen submodules: the outputs of the aten ops
    named in ``save`` (default: matmuls and attention) are kept from forward, the rest recomputed
    in backward. Activation memory lands between none and ``blocks``, for a fraction of the
    recompute cost of ``blocks`` (no matmul runs twice)."""

    kind, what = "selective", "selective activation checkpointing"

    def __init__(self, types: Sequence[str] = (), names: str | None = None, every: Positive[int] = 1,
                 save: Sequence[str] = SAVE):
        super().__init__(types, names, every)
        known = [name for name in dir(torch.ops.aten) if not name.startswith("__")]
        for op in save:
            if not isinstance(op, str) or not hasattr(torch.ops.aten, op.removeprefix("aten.")):
                close = difflib.get_close_matches(str(op).removeprefix("aten."), known, n=1)
                raise ConfigError("checkpointing.save", f"{op!r} is not an aten operator",
                                  (f"did you mean {close[0]}? " if close else "") +
                                  "name aten ops whose outputs to keep, e.g. checkpointing.save=[mm,addmm,bmm]")
        self.save = tuple(op.removeprefix("aten.") for op in save)

    def wrap(self, module: nn.Module) -> None:
        rewrap(module, functools.partial(selective_forward, module, module.__dict__.get("forward"), self.save))


@functools.lru_cache(maxsize=None)
def save_policy(save: tuple[str, ...]):
    packets = frozenset(getattr(torch.ops.aten, name) for name in save)
    return functools.partial(keep_or_recompute, packets)


def keep_or_recompute(packets, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if getattr(op, "overloadpacket", op) in packets \
        else CheckpointPolicy.PREFER_RECOMPUTE


def selective_forward(module: nn.Module, inner, save: tuple[str, ...], *args, **kwargs):
    forward = inner if inner is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    contexts = functools.partial(create_selective_checkpoint_contexts, save_policy(save))
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


# ------------------------------------------------------------------ offload


class OffloadActivations(ActivationCheckpointing):
    """Activation offloading of the chosen submodules: every storage autograd saves for backward
    inside them (parameters excepted) is copied once to host memory in forward (pinned memory on
    CUDA) and copied back when backward needs it; nothing is recomputed. On CUDA ``overlap``
    runs the copies out on a side stream, beside the forward's kernels (the copies back run on
    the compute stream). Device activation memory falls to what is saved outside the chosen
    submodules (embeddings, the head, the loss) plus, in backward, one submodule's at a time."""

    kind, what = "offload", "activation offloading"

    def __init__(self, types: Sequence[str] = (), names: str | None = None, every: Positive[int] = 1,
                 overlap: bool = True):
        super().__init__(types, names, every)
        self.overlap = overlap
        self.host = weakref.WeakSet()   # the host copies alive now (their bytes: host_bytes())
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def check(self, engine, compile) -> None:
        if getattr(compile, "mode", None) == "reduce-overhead":
            raise ConfigError("checkpointing", "offloading copies activations to host memory in forward, which CUDA "
                              "graphs (compile.mode=reduce-overhead) cannot replay",
                              "use +compile=default with +checkpointing=offload, or +checkpointing=selective")

    def wrap(self, module: nn.Module) -> None:
        rewrap(module, functools.partial(offloaded_forward, module, module.__dict__.get("forward"), self))

    def __deepcopy__(self, memo):  # an EMA copy of the model offloads through the same strategy
        return self

    def __getstate__(self):
        return {k: v for k, v in vars(self).items() if k not in ("host", "streams")}

    def __setstate__(self, state):
        vars(self).update(state, host=weakref.WeakSet(), streams={})

    def host_bytes(self) -> int:
        """Bytes of activations held in host memory now (between a forward and its backward)."""
        return sum(s.nbytes() for s in list(self.host))

    def side_stream(self, device: torch.device):
        if not (self.overlap and device.type == "cuda"):
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]


class Packed(NamedTuple):
    """A saved tensor whose storage is in host memory: what to rebuild it on its device from."""
    host: torch.Tensor            # the whole storage's bytes (uint8), on the host
    device: torch.device
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    stream: object                # the side stream the copy out ran on (None: the compute stream)


class HostCopies:
    """The pack/unpack hooks of one forward of one submodule: each storage copied out once (views
    of it, such as q, k and v of one projection, share the copy), copied back once while any of
    its views is in use in backward."""

    def __init__(self, keep: set[int], owner: OffloadActivations):
        self.keep, self.owner = keep, owner
        self.out: dict[int, tuple] = {}                          # data_ptr -> (weakref to storage, host bytes)
        self.back: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(host) -> device bytes

    def pack(self, t: torch.Tensor):
        if t.layout is not torch.strided or type(t) not in (torch.Tensor, nn.Parameter):  # sparse, DTensor ...: kept
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.keep or storage.nbytes() == 0 or t.device.type == "meta":
            return t
        found = self.out.get(ptr)
        if found is None or found[0]() is not storage:  # an address freed and reused is another storage
            found = (weakref.ref(storage), self.copy_out(storage, t.device))
            self.out[ptr] = found
        host, stream = found[1]
        return Packed(host, t.device, t.dtype, t.size(), t.stride(), t.storage_offset(), stream)

    def copy_out(self, storage, device: torch.device):
        cuda = device.type == "cuda"
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda)
        stream = self.owner.side_stream(device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # the tensor is written
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
            source.record_stream(stream)  # its memory is not reused before the copy has run
        else:
            host.copy_(source, non_blocking=cuda)
        self.owner.host.add(host.untyped_storage())
        return host, stream

    def unpack(self, packed):
        if not isinstance(packed, Packed):
            return packed
        back = self.back.get(id(packed.host))
        if back is None:
            if packed.stream is not None:
                torch.cuda.current_stream(packed.device).wait_stream(packed.stream)  # the copy out is done
            back = packed.host.to(packed.device, non_blocking=packed.device.type == "cuda")
            self.back[id(packed.host)] = back
        return torch.empty(0, dtype=packed.dtype, device=packed.device).set_(
            back.untyped_storage(), packed.offset, packed.size, packed.stride)


def offloaded_forward(module: nn.Module, inner, owner: OffloadActivations, *args, **kwargs):
    forward = inner if inner is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # the parameters as they are now (FSDP and ZeRO-3 gather them before forward): saved as they are
    keep = {p.untyped_storage().data_ptr() for p in module.parameters()}
    hooks = HostCopies(keep, owner)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        return forward(*args, **kwargs)


# ------------------------------------------------------------------ the wrapper


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module``'s forward run under ``torch.utils.checkpoint`` (idempotent)."""
    rewrap(module, functools.partial(checkpointed_forward, module, module.__dict__.get("forward")))


def rewrap(module: nn.Module, forward: functools.partial) -> None:
    # a partial of a module-level function, not a closure: copy.deepcopy and pickle follow
    # the module (an EMA copy checkpoints its own forward, not the original's)
    if not is_checkpointed(module):
        module.forward = forward


def is_checkpointed(module: nn.Module) -> bool:
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func in WRAPPERS


def checkpointed_forward(module: nn.Module, inner, *args, **kwargs):
    forward = inner if inner is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():  # eval, generation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


WRAPPERS = (checkpointed_forward, selective_forward, offloaded_forward)  # what a wrapped forward is a partial of
