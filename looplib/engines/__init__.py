"""Engines own device placement and gradient sync; they name their collectives (``engine.ranks``,
``looplib.process.collectives``) and their checkpoint format (``checkpoint_format``,
``looplib.store.formats``) rather than carry them.

``Local`` (one process), ``DDP`` (``looplib.engines.ddp``), ``FSDP`` (PyTorch's FSDP2,
``looplib.engines.fsdp``) and ``DeepSpeed`` (``looplib.engines.deepspeed``, which imports
deepspeed only when built).
"""
from .ddp import DDP
from .local import Engine, Local, Prepared, resolve_device

__all__ = ["Engine", "Local", "DDP", "Prepared", "resolve_device"]
