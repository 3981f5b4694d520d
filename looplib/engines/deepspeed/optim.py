"""The optimizer side of DeepSpeed: the optimizer as the loop sees it (``StepHooks``) and DeepSpeed's
CPU Adam as an optim group (``+optim=cpu_adam``)."""
from __future__ import annotations

import torch

from ...optim import BETAS, EPS, LR, WEIGHT_DECAY, OptimizerFactory
from ...schema import Beta, NonNegative, Positive
from .config import import_deepspeed


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


class CPUAdam(OptimizerFactory):
    """DeepSpeed's CPU Adam(W) (``deepspeed.ops.adam.DeepSpeedCPUAdam``): the optimizer that
    ZeRO-Offload runs on the CPU. Its kernel is compiled on first use (needs a C++ compiler)."""

    CLASS = "deepspeed.ops.adam.DeepSpeedCPUAdam"  # what it builds, known without compiling the kernel

    def __init__(self, lr: Positive[float] = LR, weight_decay: NonNegative[float] = WEIGHT_DECAY,
                 betas: tuple[Beta, Beta] = BETAS, eps: Positive[float] = EPS, adamw_mode: bool = True):
        super().__init__(lr, weight_decay)
        self.betas, self.eps, self.adamw_mode = tuple(betas), eps, adamw_mode

    def create(self, groups):
        import_deepspeed()
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, lr=self.lr, betas=self.betas, eps=self.eps, adamw_mode=self.adamw_mode)
