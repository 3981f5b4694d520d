"""Engines own what a distributed runtime must own: device placement, gradient sync, ranks."""
from .local import Engine, Local, resolve_device

__all__ = ["Engine", "Local", "resolve_device"]
