"""torch.compile as a strategy: ``+compile=default`` (or another mode); absent means eager.

The model is compiled in place with ``nn.Module.compile``: its class, ``state_dict`` keys and
methods stay as they were, so saving, LoRA, activation checkpointing (applied to the blocks
before this) and accumulation all see the same module. Compilation happens on the first
forward pass (seconds to minutes); a change of shape, dtype or train/eval mode recompiles.
"""
from __future__ import annotations

from typing import Literal, get_args

from torch import nn

from .errors import ConfigError

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
MODES = get_args(Mode)


class Compile:
    """Eager PyTorch: the null object."""

    def wrap(self, model: nn.Module) -> nn.Module:
        return model


NoCompile = Compile


class TorchCompile(Compile):
    """``model.compile(mode=..., backend=..., fullgraph=..., dynamic=...)``.

    ``reduce-overhead`` adds CUDA graphs (fewer kernel launches for small batches);
    ``max-autotune`` benchmarks kernels at compile time (slow to compile, fastest to run).
    """

    def __init__(self, mode: Mode = "default", backend: str = "inductor", fullgraph: bool = False,
                 dynamic: bool | None = None):
        if mode not in MODES:
            raise ConfigError("compile.mode", f"unknown mode {mode!r}", f"use one of {', '.join(MODES)}")
        import torch._dynamo
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ConfigError("compile.backend", f"unknown backend {backend!r}",
                              f"use inductor (or one of {', '.join(backends)})")
        self.mode, self.backend, self.fullgraph, self.dynamic = mode, backend, fullgraph, dynamic

    def wrap(self, model):
        options = {"mode": self.mode} if self.backend == "inductor" else {}
        model.compile(backend=self.backend, fullgraph=self.fullgraph, dynamic=self.dynamic, **options)
        return model
