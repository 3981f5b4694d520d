"""Precision strategies: fp32 (the null object), tf32, fp16 with GradScaler, bf16.

The loop calls, in order: ``autocast()`` around forward and loss, ``backward(loss)``,
then at the accumulation boundary ``unscale(optimizer)`` (before clipping) and
``step(optimizer)``. Each class overrides only what differs from plain fp32.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Annotated, Literal, get_args

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

    def skips_on(self, optimizer: torch.optim.Optimizer) -> str | torch.Tensor | None:
        """For a clip-and-step compiled in one region (``compile.optimizer=true``), what skips an
        update there, on the device: ``"norm"`` (a non-finite gradient norm, as ``step``), a device
        flag (fp16: the scaler's), or None (nothing: ``skip_nonfinite=false``)."""
        return "norm" if self.skip_nonfinite else None

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """What follows an update made (or skipped) in such a region (fp16: the scaler's update)."""

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


Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
RECIPES = get_args(Recipe)


class FP8(BF16):
    """float8 matmuls through torchao (``pip install 'looplib[fp8]'``, imported only when chosen)
    on GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell), inside bf16 autocast.

    ``nn.Linear`` layers become torchao's ``Float8Linear`` with dynamic scaling (``recipe``:
    ``tensorwise``, one scale per tensor; ``rowwise``, one per row: closer to bf16, a little slower
    per matmul; ``rowwise_with_gw_hp``: rowwise with the weight gradient in high precision), except
    the output projection (``lm_head``, sensitive and often tied to the embedding), layers named in
    ``skip``, layers whose widths are not multiples of 16 (the fp8 kernels need them), and, with
    ``filter: size`` (the default), layers too small for fp8 to pay for its casts (``big_enough``).
    Under FSDP2 (``+engine=fsdp``) with the tensorwise recipe, the sharded weights are cast to fp8
    before they are all-gathered (half the bytes of bf16 on the wire; ``fsdp_all_gather``: ``auto``
    does so exactly then, ``true`` insists, ``false`` gathers bf16), and the scales of every weight
    are computed in one all-reduce after each optimizer step. Weights, optimizer state and
    checkpoints keep their dtype and names.
    """

    name = "fp8"
    sharded = False  # set by the FSDP engine (precision_for) before setup

    def __init__(self, skip_nonfinite: bool = True, skip: list[str] | None = None, recipe: Recipe = "tensorwise",
                 filter: Literal["size", "none"] = "size", fsdp_all_gather: Literal["auto"] | bool = "auto"):
        super().__init__(skip_nonfinite)
        if recipe not in RECIPES:
            raise ConfigError("precision.recipe", f"unknown fp8 recipe {recipe!r}", f"use one of {', '.join(RECIPES)}")
        if filter not in ("size", "none"):
            raise ConfigError("precision.filter", f"unknown filter {filter!r}",
                              "use size (small layers stay in bf16) or none (every layer that fits the kernels)")
        if fsdp_all_gather not in ("auto", True, False):
            raise ConfigError("precision.fsdp_all_gather", f"{fsdp_all_gather!r} is not auto, true or false",
                              "use auto, true or false")
        if fsdp_all_gather is True and recipe != "tensorwise":
            raise ConfigError("precision.fsdp_all_gather", f"fp8 all-gathers need the tensorwise recipe (a weight is "
                              f"cast with one scale before FSDP gathers it), not {recipe}",
                              "use precision.recipe=tensorwise, or precision.fsdp_all_gather=auto (bf16 gathers)")
        self.skip, self.recipe, self.filter, self.fsdp_all_gather = list(skip or []), recipe, filter, fsdp_all_gather
        self.model = None

    def setup(self, device):
        if self.fsdp_all_gather is True and not self.sharded:
            raise ConfigError("precision.fsdp_all_gather", "fp8 all-gathers are FSDP2's, and this run has no "
                              "+engine=fsdp", "use +engine=fsdp, or leave precision.fsdp_all_gather=auto")
        super().setup(device)
        fix = "use +precision=bf16 on this device (fp8 runs on H100, L4, RTX 4090 and newer)"
        if self.device.type != "cuda":
            raise ConfigError("precision", f"fp8 needs a CUDA GPU of compute capability >= 8.9, not {self.device}", fix)
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < (8, 9):
            raise ConfigError("precision", f"fp8 needs compute capability >= 8.9; "
                              f"{torch.cuda.get_device_name(self.device)} has {major}.{minor}", fix)
        import_torchao_float8()

    def all_gather(self) -> bool:
        """Whether FSDP gathers the weights in fp8 (see the class's note)."""
        if self.fsdp_all_gather == "auto":
            return self.sharded and self.recipe == "tensorwise"
        return bool(self.fsdp_all_gather)

    def convert(self, model):
        self.model = model
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        float8_training(model, self.skip, self.recipe, by_size=self.filter == "size", fsdp_all_gather=self.all_gather())
        fp8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        logging.getLogger("looplib").info(
            "fp8 (%s): %d of %d linear layers in fp8, the rest in bf16 (the head, precision.skip, widths not multiples "
            "of 16%s); FSDP all-gathers in %s", self.recipe, fp8, linears, ", too small: filter=size"
            if self.filter == "size" else "", "fp8" if self.all_gather() else "bf16" if self.sharded else "-")
        return model

    def step(self, optimizer, grad_norm=None):
        skipped = super().step(optimizer, grad_norm)
        self.stepped(optimizer)
        return skipped

    def stepped(self, optimizer):
        if self.model is not None and self.all_gather():  # the next gathers' scales, all in one all-reduce
            import_torchao_float8().precompute_float8_dynamic_scale_for_fsdp(self.model)


def import_torchao_float8():
    return need("torchao.float8", "fp8", "precision", "+precision=fp8")


def big_enough(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether a linear layer's matmul is large enough for fp8 to pay for its casts (the rule of
    ``precision.filter=size``): the thresholds are torchao's H100 measurements of one linear
    layer's forward and backward, fp8 against bf16 (torchao/float8's README, performance tables;
    its ``_auto_filter_for_recipe`` draws the same lines). tensorwise: more than 4096 inputs or
    more than 1024 outputs; rowwise (and rowwise_with_gw_hp): more than 2048 outputs and more than
    1024 inputs, and not both at most 4096 outputs and at most 2048 inputs."""
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return k > 4096 or n > 1024
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)


def float8_training(model: torch.nn.Module, skip: list[str] = (), recipe: str = "tensorwise", by_size: bool = False,
                    fsdp_all_gather: bool = False) -> torch.nn.Module:
    """``torchao.float8.convert_to_float8_training`` on every ``nn.Linear`` whose widths are
    multiples of 16, except the model's ``lm_head``, modules whose names end with one in ``skip``
    and, with ``by_size``, layers too small to gain (``big_enough``). ``fsdp_all_gather``: FSDP2
    gathers the converted weights in fp8 (tensorwise only). Converts in place (no device needed)."""
    import dataclasses
    float8 = import_torchao_float8()
    head = getattr(model, "lm_head", None)
    heads = {id(head)} | {id(m) for name, m in model.named_modules() if name.split(".")[-1] in ("lm_head", "head")}

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or id(module) in heads:
            return False
        if any(fqn == s or fqn.endswith("." + s) for s in skip):
            return False
        if by_size and not big_enough(module.in_features, module.out_features, recipe):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
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
        if self.device.type == "cpu":  # CPUs have no fast float16 matmuls: a user would only see a slow run
            logging.getLogger("looplib").warning("fp16 on a CPU has no fast float16 kernels and trains slower than fp32 "
                                                 "(2x to 10x, by model shape); +precision=fp32 is the fast choice on a CPU")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer):
        self.scaler.unscale_(optimizer)

    def step(self, optimizer, grad_norm=None):
        self.scaler.step(optimizer)  # skips the update when gradients are not finite
        self.stepped(optimizer)
        if grad_norm is not None and fused_skip(optimizer):
            # the scaler handed its inf/NaN flag to the fused kernel: no sync, and the step hooks
            # fire either way. Gradients (unscaled) hold inf/NaN exactly when their norm does.
            return nonfinite(grad_norm)
        return None

    def skips_on(self, optimizer):
        # the scaler's own inf/NaN flag, found by unscale (what scaler.step reads on the host)
        return sum(self.scaler._found_inf_per_device(optimizer).values())

    def stepped(self, optimizer):
        self.scaler.update()  # shrinks the scale after a skipped step, grows it after enough good ones

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
