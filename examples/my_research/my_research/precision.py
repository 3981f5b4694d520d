"""A precision: bf16 autocast, except that normalisation layers always compute in fp32.

Autocast leaves the choice of dtype per operator to PyTorch's op lists; whether a norm layer
runs in fp32 then depends on the device and on its input's dtype. This precision makes it a
rule: while its autocast context is open, every normalisation module runs with autocast off
and its inputs cast to fp32, so its statistics and output are fp32.

(The hooks live only inside the autocast context: a backward pass that re-runs the forward,
as activation checkpointing does, would re-run norms without them.)
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from looplib.optim import is_no_decay_module
from looplib.precision import BF16


def is_norm(module: nn.Module) -> bool:
    """torch's norm layers, and leaf modules named like one (LlamaRMSNorm, T5LayerNorm, ...)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or next(module.children(), None) is not None:
        return False
    return is_no_decay_module(module)


class BF16FP32Norms(BF16):
    name = "bf16-fp32-norms"

    def autocast(self):
        return self._norms_in_fp32(super().autocast())

    @contextmanager
    def _norms_in_fp32(self, outer):
        stack = []  # one autocast-off context per norm module being run (they do not nest, but may)

        def before(module, args):
            if not is_norm(module):
                return None
            off = torch.autocast(self.device.type, enabled=False)
            off.__enter__()
            stack.append(off)
            return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

        def after(module, args, output):
            if is_norm(module):
                stack.pop().__exit__(None, None, None)

        with outer:
            hooks = [nn.modules.module.register_module_forward_pre_hook(before),
                     nn.modules.module.register_module_forward_hook(after)]
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()
                while stack:  # a forward that raised inside a norm: turn autocast back on
                    stack.pop().__exit__(None, None, None)
