"""What the loop sees under DeepSpeed: a precision whose verbs call the ``DeepSpeedEngine`` and an
optimizer whose step hooks fire once per applied DeepSpeed step."""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from ..precision import Precision

if TYPE_CHECKING:
    from .deepspeed import DeepSpeed


class DeepSpeedPrecision(Precision):
    """The precision the loop sees under DeepSpeed (chosen at assembly by ``DeepSpeed.precision_for``):
    DeepSpeed scales, unscales, clips and steps, with the dtype and loss-scale settings of the
    precision the job chose (``chosen``), which DeepSpeed's config is derived from.

    The model is already in DeepSpeed's 16-bit format (bf16/fp16 sections), so no autocast;
    the loss arrives divided by the window's items and is not divided again. Before ``prepare``
    (``batch_size=auto``'s probe of the plain model) every verb is the chosen precision's."""

    # the verbs DeepSpeed performs itself once prepared: a precision of the user's own that overrides one of
    # them would never be called, and the run would train at DeepSpeed's precision and exit 0
    BYPASSED = ("convert", "autocast", "backward", "unscale", "step", "skips_on", "stepped")

    def __init__(self, engine: "DeepSpeed", chosen: Precision):
        overridden = bypassed_overrides(type(chosen), self.BYPASSED)
        if overridden:
            raise ConfigError("precision._target_", f"{type(chosen).__module__}.{type(chosen).__qualname__} overrides "
                              f"{', '.join(overridden)}, which +engine=deepspeed never calls (DeepSpeed casts, scales "
                              "and steps itself)", "use +precision=fp32, fp16 or bf16 with +engine=deepspeed, or "
                              "+engine=ddp / fsdp for a precision of your own")
        self.engine, self.chosen = engine, chosen
        self.name = f"{getattr(chosen, 'name', 'custom')} (DeepSpeed)"
        self.dtype, self.device = chosen.dtype, getattr(chosen, "device", None)
        self.scaler_args = dict(getattr(chosen, "scaler_args", {}))

    def setup(self, device) -> None:
        pass  # the chosen precision was set up by precision_for

    def close(self) -> None:
        self.chosen.close()

    def autocast(self):
        return nullcontext() if self.engine.ds is not None else self.chosen.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine.ds is None:
            return self.chosen.backward(loss)
        self.engine.ds.backward(loss, scale_wrt_gas=False)  # accumulates only: no hidden step

    def unscale(self, optimizer) -> None:
        if self.engine.ds is None:
            self.chosen.unscale(optimizer)

    def step(self, optimizer, grad_norm=None):
        if self.engine.ds is None:
            return self.chosen.step(optimizer, grad_norm)
        self.engine.ds.step()                        # reduce, unscale, clip, update, zero
        if self.engine.ds.was_step_applied():        # an fp16 overflow skips the update
            self.engine.steps.stepped()
        return None

    def state_dict(self) -> dict:
        return self.chosen.state_dict() if self.engine.ds is None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.engine.ds is None:
            self.chosen.load_state_dict(state)


class StepHooks:
    """The optimizer as the loop sees it under DeepSpeed. ZeRO wraps the real optimizer and
    fires its hooks more than once per update, so step hooks (the telemetry's count of real
    updates) fire here, once per applied DeepSpeed step. Gradients are zeroed by DeepSpeed."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.hooks = optimizer, []

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def register_step_post_hook(self, hook):
        self.hooks.append(hook)

    def stepped(self) -> None:
        for hook in self.hooks:
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # DeepSpeedEngine.step() already did


def bypassed_overrides(cls: type, verbs: tuple[str, ...]) -> list[str]:
    """The verbs a class from outside looplib defines itself, above the looplib precision it
    derives from (looplib's own precisions are what DeepSpeed's config is derived from)."""
    own = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "looplib":
            break
        own += [verb for verb in verbs if verb in vars(klass) and verb not in own]
    return own
