"""The precision the loop sees under DeepSpeed: before ``prepare`` the chosen precision's verbs, after it
the ``DeepSpeedEngine``'s, which ``attach`` hands over; and the refusal of a user's precision whose verbs
DeepSpeed would bypass."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ...errors import ConfigError
from ...precision import Precision


class DeepSpeedPrecision(Precision):
    """The precision the loop sees under DeepSpeed (chosen at assembly by ``DeepSpeed.precision_for``):
    DeepSpeed scales, unscales, clips and steps, with the dtype and loss-scale settings of the
    precision the job chose (``chosen``), which DeepSpeed's config is derived from.

    Until ``attach`` hands it the ``DeepSpeedEngine`` (``DeepSpeed.prepare`` does, once) every verb
    is the chosen precision's (``batch_size=auto``'s probe of the plain model). From then on the
    model is in DeepSpeed's 16-bit format (bf16/fp16 sections), so no autocast, and the loss
    arrives divided by the window's items and is not divided again."""

    # the verbs DeepSpeed performs itself once prepared: a precision of the user's own that overrides one of
    # them would never be called, and the run would train at DeepSpeed's precision and exit 0
    BYPASSED = ("convert", "autocast", "backward", "unscale", "step", "skips_on", "stepped")

    def __init__(self, chosen: Precision):
        overridden = bypassed_overrides(type(chosen), self.BYPASSED)
        if overridden:
            raise ConfigError("precision._target_", f"{type(chosen).__module__}.{type(chosen).__qualname__} overrides "
                              f"{', '.join(overridden)}, which +engine=deepspeed never calls (DeepSpeed casts, scales "
                              "and steps itself)", "use +precision=fp32, fp16 or bf16 with +engine=deepspeed, or "
                              "+engine=ddp / fsdp for a precision of your own")
        self.chosen = chosen
        self.name = f"{getattr(chosen, 'name', 'custom')} (DeepSpeed)"
        self.dtype, self.device = chosen.dtype, getattr(chosen, "device", None)
        self.scaler_args = dict(getattr(chosen, "scaler_args", {}))
        self.ds = None       # the DeepSpeedEngine, from attach
        self.steps = None    # the optimizer as the loop sees it (StepHooks), from attach

    def attach(self, ds, steps) -> None:
        """From here on DeepSpeed's verbs: ``ds`` (the ``DeepSpeedEngine``) backs, steps and
        zeroes; ``steps`` (the loop's optimizer) fires its hooks once per applied step."""
        self.ds, self.steps = ds, steps

    def setup(self, device) -> None:
        pass  # the chosen precision was set up by precision_for

    def close(self) -> None:
        self.chosen.close()

    def autocast(self):
        return self.chosen.autocast() if self.ds is None else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.ds is None:
            return self.chosen.backward(loss)
        self.ds.backward(loss, scale_wrt_gas=False)  # accumulates only: no hidden step

    def unscale(self, optimizer) -> None:
        if self.ds is None:
            self.chosen.unscale(optimizer)

    def step(self, optimizer, grad_norm=None):
        if self.ds is None:
            return self.chosen.step(optimizer, grad_norm)
        self.ds.step()                        # reduce, unscale, clip, update, zero
        if self.ds.was_step_applied():        # an fp16 overflow skips the update
            self.steps.stepped()
        return None

    def state_dict(self) -> dict:
        return self.chosen.state_dict() if self.ds is None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.ds is None:
            self.chosen.load_state_dict(state)


def bypassed_overrides(cls: type, verbs: tuple[str, ...]) -> list[str]:
    """The verbs a class from outside looplib defines itself, above the looplib precision it
    derives from (looplib's own precisions are what DeepSpeed's config is derived from)."""
    own = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "looplib":
            break
        own += [verb for verb in verbs if verb in vars(klass) and verb not in own]
    return own
