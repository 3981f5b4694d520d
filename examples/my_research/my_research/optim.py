"""An optimizer factory for an optimizer torch does not ship: Lion (sign of an interpolated
momentum; one state tensor, 4 bytes/param, half of AdamW's 8). Chen et al., 2023.

Lion's updates all have magnitude ``lr``, so it wants a learning rate 3-10x smaller than
AdamW's and a weight decay 3-10x larger.
"""
from __future__ import annotations

import torch

from looplib.optim import OptimizerFactory
from looplib.schema import Beta, NonNegative, Positive


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m.lerp(p.grad, 1 - beta1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)
        return loss


class LionFactory(OptimizerFactory):
    """looplib hands ``create`` its parameter groups (decayed weights / the rest)."""

    def __init__(self, lr: Positive[float], weight_decay: NonNegative[float] = 0.0,
                 betas: tuple[Beta, Beta] = (0.9, 0.99)):  # annotated: looplib checks a bad value at build time
        super().__init__(lr, weight_decay)
        self.betas = tuple(betas)

    def create(self, groups):
        return Lion(groups, lr=self.lr, betas=self.betas)
