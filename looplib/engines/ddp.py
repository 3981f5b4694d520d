"""PyTorch DistributedDataParallel: one process per device, gradients averaged by all-reduce.

    torchrun --nproc_per_node 4 -m looplib.train +engine=ddp
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m looplib.train +engine=ddp

``batch_size`` stays the micro-batch *per process*: the global batch is
batch_size x accum_steps x world_size. Each rank reads its own slice of every epoch (the
loader's ``EpochSampler`` takes rank and world), skips the all-reduce on every micro-batch but
the window's last (``no_sync``), and only rank 0 logs and writes.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..process.group import start
from ..schema import Positive
from .distributed import Distributed

log = logging.getLogger("looplib")


class DDP(Distributed):
    """``torch.nn.parallel.DistributedDataParallel``; gloo on the CPU, NCCL on CUDA."""

    several_processes = True  # one rank of several (torchrun, deepspeed, SLURM)

    def __init__(self, device: str | torch.device = "auto", bucket_cap_mb: Positive[float] = 25.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True,
                 static_graph: bool = False, timeout_s: Positive[float] = 1800):
        super().__init__(device, timeout_s)
        self.ddp_args = dict(bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                             gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)

    def setup(self, model: nn.Module) -> nn.Module:
        start(self)
        model = model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        log.info("DDP: %d processes, backend %s, %s each", self.world_size, dist.get_backend(), self.device)
        return DistributedDataParallel(model, device_ids=ids, **self.ddp_args)

    def accumulating(self, model: nn.Module, last: bool):
        return super().accumulating(model, last) if last else model.no_sync()  # all-reduce on the last only

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model
