"""Optimizer factories (the group ``optim``; learning-rate schedules: ``looplib.schedule``).

A factory holds settings from its config file (``conf/optim/<name>.yaml``) and builds the
optimizer once the model exists: runtime objects are passed where they are used, never put
in config. Every factory shares one parameter-grouping policy, ``param_groups``.
"""
from __future__ import annotations

from importlib import resources
from typing import Annotated, Literal

import torch
from torch import nn

from .errors import ConfigError, need
from .schema import Beta, NonNegative, Positive, Range

# The optimizer defaults, one set for the command line (conf/config.yaml's lr and weight_decay,
# conf/optim/*.yaml), the classes below and ``train_model``; tests/cli/test_validation.py holds them
# equal. lr and weight decay suit the small models looplib ships; betas (0.9, 0.95) are the
# usual choice for transformer language models (torch's own default beta2 is 0.999).
LR = 2e-3
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8

# Parameters owned by these modules never decay (by module type, not by parameter name).
NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase, nn.RMSNorm,
)


def is_no_decay_module(module: nn.Module) -> bool:
    # Third-party norms (LlamaRMSNorm, T5LayerNorm, ...) do not subclass torch's: they are
    # recognised by their class name, the one convention all of them follow.
    return isinstance(module, NO_DECAY_MODULES) or type(module).__name__.endswith("Norm")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and biases / norm weights / embeddings without decay.

    Parameters keep ``model.parameters()`` order; shared (tied) parameters appear once and do
    not decay if any module that owns them is a no-decay module.
    """
    no_decay: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "bias" or is_no_decay_module(module):
                no_decay.add(id(p))
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if id(p) not in no_decay]
    rest = [p for p in trainable if id(p) in no_decay]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": rest, "weight_decay": 0.0}) if g["params"]]


def embedding_weights(model: nn.Module) -> list[nn.Parameter]:
    return [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


class OptimizerFactory:
    """Base class: subclasses implement ``create(groups)``; ``build(model)`` is what the loop uses."""

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY):
        self.lr, self.weight_decay = lr, weight_decay

    def check(self, engine, peft) -> None:
        """Build time, before the model exists: refuse an engine or adapter this optimizer cannot train."""

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.create(param_groups(model, self.weight_decay))

    def create(self, groups: list[dict]) -> torch.optim.Optimizer:
        raise NotImplementedError


class AdamW(OptimizerFactory):
    """``torch.optim.AdamW``; ``impl`` picks fused, foreach or for-loop kernels (auto: fused on CUDA)."""

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY,
                 betas: tuple[Beta, Beta] = BETAS, eps: Positive[float] = EPS,
                 impl: Literal["auto", "fused", "foreach", "for-loop"] = "auto"):
        super().__init__(lr, weight_decay)
        if impl not in ("auto", "fused", "foreach", "for-loop"):
            raise ConfigError("optim.impl", f"unknown implementation {impl!r}",
                              "use auto, fused, foreach or for-loop")
        self.betas, self.eps, self.impl = tuple(betas), eps, impl

    def create(self, groups):
        on_cuda = all(p.is_cuda for g in groups for p in g["params"])
        impl = ("fused" if on_cuda else "foreach") if self.impl == "auto" else self.impl
        kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps, **kw)


class SGD(OptimizerFactory):
    """``torch.optim.SGD`` with momentum (4 bytes of state per parameter)."""

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY,
                 momentum: Beta = 0.9, nesterov: bool = False):
        super().__init__(lr, weight_decay)
        if nesterov and momentum == 0:
            raise ConfigError("optim.nesterov", "Nesterov momentum needs a momentum (got momentum=0)",
                              "set optim.momentum above 0, or optim.nesterov=false")
        self.momentum, self.nesterov = momentum, nesterov

    def create(self, groups):
        return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)


class Adafactor(OptimizerFactory):
    """``torch.optim.Adafactor``: factored second moments, a little over 4 bytes/param for matrices."""

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY,
                 beta2_decay: Annotated[float, Range(le=0)] = -0.8,
                 eps: tuple[NonNegative[float] | None, NonNegative[float]] = (None, 1e-3),
                 d: Annotated[float, Range(ge=1)] = 1.0):
        super().__init__(lr, weight_decay)
        self.beta2_decay, self.eps, self.d = beta2_decay, tuple(eps), d

    def create(self, groups):
        return torch.optim.Adafactor(groups, lr=self.lr, beta2_decay=self.beta2_decay,
                                     eps=self.eps, d=self.d)


class Adam8bit(OptimizerFactory):
    """bitsandbytes 8-bit Adam(W): 2 bytes of state per parameter.

    Tensors under ``min_8bit_size`` elements keep 32-bit state (bitsandbytes' own rule), and
    embedding weights keep 32-bit state through bitsandbytes' override manager, as its
    authors advise for stability. bitsandbytes is imported here, only when chosen.
    """

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY,
                 betas: tuple[Beta, Beta] = BETAS, eps: Positive[float] = EPS,
                 min_8bit_size: NonNegative[int] = 4096, embeddings_32bit: bool = True):
        super().__init__(lr, weight_decay)
        self.betas, self.eps = tuple(betas), eps
        self.min_8bit_size, self.embeddings_32bit = min_8bit_size, embeddings_32bit
        self.bnb = import_bitsandbytes()

    def build(self, model):
        opt = self.create(param_groups(model, self.weight_decay))
        # bitsandbytes keeps overrides in a process-wide table keyed by id(parameter): drop
        # entries left for our ids by earlier, garbage-collected parameters before adding ours.
        manager = self.bnb.optim.GlobalOptimManager.get_instance()
        for group in opt.param_groups:
            for p in group["params"]:
                manager.pid2config.pop(id(p), None)
        if self.embeddings_32bit:
            for weight in embedding_weights(model):
                manager.override_config(weight, "optim_bits", 32)
        return opt

    def create(self, groups):
        return self.bnb.optim.AdamW8bit(groups, lr=self.lr, betas=self.betas, eps=self.eps,
                                        min_8bit_size=self.min_8bit_size)


class TorchaoAdam8bit(OptimizerFactory):
    """torchao's 8-bit AdamW (``+optim=adam8bit_ao``; ``pip install 'looplib[fp8]'``, torchao,
    imported only when chosen): block-wise 8-bit moments like bitsandbytes' (tensors of at least
    4096 elements that split into whole blocks; others keep moments in the parameter's dtype),
    with each parameter's update one kernel made by torch.compile (compiled at the first step)."""

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY,
                 betas: tuple[Beta, Beta] = BETAS, eps: Positive[float] = EPS, block_size: Positive[int] = 256,
                 bf16_stochastic_round: bool = False):
        super().__init__(lr, weight_decay)
        self.betas, self.eps, self.block_size = tuple(betas), eps, block_size
        self.bf16_stochastic_round = bf16_stochastic_round
        self.torchao_optim = need("torchao.optim", "fp8", "optim", "+optim=adam8bit_ao",
                                  "use +optim=adam8bit (bitsandbytes)")

    def create(self, groups):
        return self.torchao_optim.AdamW8bit(groups, lr=self.lr, betas=self.betas, eps=self.eps,
                                            block_size=self.block_size,
                                            bf16_stochastic_round=self.bf16_stochastic_round)


def import_bitsandbytes(setting: str = "optim", what: str = "this optimizer", otherwise: str = "choose +optim=adamw"):
    """bitsandbytes, quiet: its CPU build warns at import (and at its first 4-bit op) about a
    missing ``kernels`` package; the warning is about code the user does not own."""
    import logging
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        return need("bitsandbytes", "bnb", setting, what, otherwise)


def list_optimizers() -> list[str]:
    """The optimizer options ``+optim=<name>`` accepts (the files under conf/optim/)."""
    folder = resources.files("looplib.conf") / "optim"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def built_class(factory: "OptimizerFactory") -> type:
    """The optimizer class a factory builds (engines check where it runs), found on a throwaway
    module without consuming randomness: the run's seeded initialisation stays as it was."""
    if getattr(factory, "builds", None) is not None:  # it says (looplib.muon.Muon needs a model with blocks)
        return factory.builds
    with torch.random.fork_rng(devices=[]):
        return type(factory.build(torch.nn.Linear(1, 1)))
