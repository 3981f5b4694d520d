"""Precision strategies: fp32 (the null object), tf32, fp16 with GradScaler, bf16.

The loop calls, in order: ``autocast()`` around forward and loss, ``backward(loss)``,
then at the accumulation boundary ``unscale(optimizer)`` (before clipping) and
``step(optimizer)``. Each class overrides only what differs from plain fp32.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated, Literal

import torch

from .errors import ConfigError, need
from .schema import Positive, Range


class Precision:
    """fp32: plain PyTorch. Every other precision overrides two or three of these methods."""

    name = "fp32"
    dtype: torch.dtype | None = None  # the autocast dtype (None: no autocast, weights as they are)
    scaler: torch.amp.GradScaler | None = None

    def __init__(self, skip_nonfinite: bool = True):
        # Skip a step whose gradient norm is inf/NaN. Fused optimizers (AdamW's default on CUDA)
        # skip on the device, without a sync; others need the norm on the host: one host-device
        # sync per step, which skip_nonfinite=False trades away with the safety.
        self.skip_nonfinite = skip_nonfinite

    def setup(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def close(self) -> None:
        """The run has ended: put back any process-wide setting ``setup`` changed (TF32's flags),
        so that the next run in this process (a sweep's next job, a second ``train_model``) starts
        from what the process had."""

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Swap modules the precision computes differently (fp8: Float8Linear); others: as is."""
        return model

    def autocast(self):
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``.grad`` hold true gradients before clipping (a no-op without a scaler)."""

    def step(self, optimizer: torch.optim.Optimizer,
             grad_norm: torch.Tensor | None = None) -> torch.Tensor | None:
        """Update, unless the gradients are not finite. Returns None when the optimizer's step
        hooks tell whether it updated, or a device tensor (1.0: skipped) when a fused kernel
        made that choice on the device, where no hook can see it."""
        if not self.skip_nonfinite or grad_norm is None:
            optimizer.step()
            return None
        if fused_skip(optimizer):
            return step_unless(optimizer, grad_norm)
        if torch.isfinite(grad_norm):  # the host-device sync
            optimizer.step()
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


FP32 = Precision


class TF32(Precision):
    """fp32 storage, TensorFloat-32 matmuls and convolutions on Ampere and newer GPUs."""

    name = "tf32"

    before: tuple[bool, bool] | None = None

    def setup(self, device):
        super().setup(device)
        if self.before is None:
            self.before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def close(self):
        if self.before is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.before
            self.before = None


class Autocast(Precision):
    """Mixed precision: fp32 weights, forward under ``torch.autocast`` in ``dtype``."""

    dtype: torch.dtype

    def setup(self, device):
        super().setup(device)
        check_autocast(self.name, self.device, self.dtype)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)


class BF16(Autocast):
    """bfloat16 autocast. Same exponent range as fp32, so no loss scaling and no scaler."""

    name = "bf16"
    dtype = torch.bfloat16


class FP8(BF16):
    """float8 matmuls through torchao (``pip install 'looplib[fp8]'``, imported only when chosen)
    on GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell), inside bf16 autocast.

    Every ``nn.Linear`` whose input and output widths are multiples of 16 (what the fp8 matmul
    kernels need) becomes torchao's ``Float8Linear`` (dynamic per-tensor scaling: e4m3 for
    inputs and weights, e5m2 for gradients); the output projection (``lm_head``, sensitive and
    often tied to the embedding) and layers listed in ``skip`` stay in bf16. Weights, optimizer
    state and checkpoints keep their dtype and names.
    """

    name = "fp8"

    def __init__(self, skip_nonfinite: bool = True, skip: list[str] | None = None,
                 recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"):
        super().__init__(skip_nonfinite)
        self.skip, self.recipe = list(skip or []), recipe

    def setup(self, device):
        super().setup(device)
        fix = "use +precision=bf16 on this device (fp8 runs on H100, L4, RTX 4090 and newer)"
        if self.device.type != "cuda":
            raise ConfigError("precision", f"fp8 needs a CUDA GPU of compute capability >= 8.9, not {self.device}", fix)
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < (8, 9):
            raise ConfigError("precision", f"fp8 needs compute capability >= 8.9; "
                              f"{torch.cuda.get_device_name(self.device)} has {major}.{minor}", fix)
        import_torchao_float8()

    def convert(self, model):
        return float8_training(model, self.skip, self.recipe)


def import_torchao_float8():
    return need("torchao.float8", "fp8", "precision", "+precision=fp8")


def float8_training(model: torch.nn.Module, skip: list[str] = (), recipe: str = "tensorwise") -> torch.nn.Module:
    """``torchao.float8.convert_to_float8_training`` on every ``nn.Linear`` whose widths are
    multiples of 16, except the model's ``lm_head`` and modules whose names end with one in
    ``skip``. Converts in place (no device needed); returns the model."""
    float8 = import_torchao_float8()
    head = getattr(model, "lm_head", None)
    heads = {id(head)} | {id(m) for name, m in model.named_modules() if name.split(".")[-1] in ("lm_head", "head")}

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or id(module) in heads:
            return False
        if any(fqn == s or fqn.endswith("." + s) for s in skip):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return float8.convert_to_float8_training(model, config=config, module_filter_fn=wanted)


class FP16(Autocast):
    """float16 autocast with a dynamic loss scaler (``torch.amp.GradScaler``).

    A step whose gradients hold inf/NaN is skipped by the scaler and the scale shrinks;
    the loop counts skipped steps through an optimizer step hook.
    """

    name = "fp16"
    dtype = torch.float16
    scaler_class = torch.amp.GradScaler  # an engine may choose another at assembly (FSDP: ShardedGradScaler)

    def __init__(self, init_scale: Positive[float] = 2.0**16, growth_factor: Annotated[float, Range(gt=1)] = 2.0,
                 backoff_factor: Annotated[float, Range(gt=0, lt=1)] = 0.5, growth_interval: Positive[int] = 2000):
        super().__init__(skip_nonfinite=False)  # the scaler itself skips non-finite steps
        self.scaler_args = dict(init_scale=init_scale, growth_factor=growth_factor,
                                backoff_factor=backoff_factor, growth_interval=growth_interval)

    def setup(self, device):
        super().setup(device)
        self.scaler = self.scaler_class(self.device.type, **self.scaler_args)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer):
        self.scaler.unscale_(optimizer)

    def step(self, optimizer, grad_norm=None):
        self.scaler.step(optimizer)  # skips the update when gradients are not finite
        self.scaler.update()
        if grad_norm is not None and fused_skip(optimizer):
            # the scaler handed its inf/NaN flag to the fused kernel: no sync, and the step hooks
            # fire either way. Gradients (unscaled) hold inf/NaN exactly when their norm does.
            return nonfinite(grad_norm)
        return None

    def state_dict(self):
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state["scaler"])


def fused_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer can skip an update on the device (torch's fused Adam, AdamW, SGD,
    ...: GradScaler's protocol, a ``found_inf`` tensor read by the kernel)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def nonfinite(grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 where the norm is inf/NaN, else 0.0: a float flag on the norm's device (no sync)."""
    return (~torch.isfinite(grad_norm)).float()


def step_unless(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """Step a fused optimizer, which leaves weights, moments and step counts alone where the
    norm is inf/NaN; the choice stays on the device. Returns the skip flag (1.0: skipped)."""
    found_inf = nonfinite(grad_norm)
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    return found_inf


def check_autocast(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a precision the device cannot run, once, at build time."""
    fix = "choose another precision (+precision=fp32 or +precision=bf16) or another device"
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError("precision", f"{name} needs autocast, which {device.type} does not offer", fix)
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision", f"bf16 is not supported by {torch.cuda.get_device_name(device)}",
                          "use +precision=fp16 on this GPU")
    if not autocast_works(device, dtype):
        raise ConfigError("precision", f"{name} autocast does not run on {device}", fix)


def autocast_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Run one tiny matmul under autocast: the only reliable test of what a device can do."""
    try:
        with torch.autocast(device.type, dtype=dtype):
            x = torch.ones(8, 8, device=device)
            return (x @ x).dtype == dtype
    except (RuntimeError, TypeError, ValueError):
        return False
