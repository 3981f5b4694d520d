"""Memory planner: ``python -m looplib.plan [--world-size N] [--memory-gib G] <train overrides>``.

Prints, for the job ``python -m looplib.train <overrides>`` would run, where the memory goes
(the anatomy of the single-GPU guides), in bytes:

- static, exact (equal to the bytes of the real tensors; ``tests/cli/test_plan.py`` checks it):
  weights, the 16-bit copies autocast makes of matmul weights under mixed precision (so
  4 bytes/param in fp32, about 6 mixed), gradients, optimizer state;
- activations saved for backward per micro-batch for each activation strategy (none, blocks,
  selective, offload: on the device and, offloaded, in host memory), measured by running the
  model on the meta device (no memory, no compute) with attention counted as a fused kernel
  saves it (q, k, v, output, logsumexp); on the CPU within 5% of the bytes a real forward
  holds for backward (``tests/unit/test_activation_memory.py``); and what backward allocates on top
  at most: one chosen module recomputed or brought back, or the cross-entropy's backward (two
  gradients the size of the fp32 logits, with everything saved still held: GBs for a large
  vocabulary);
- per rank under DeepSpeed ZeRO 1/2/3, with and without offload, and under FSDP2 (shards plus
  the largest unit gathered whole), for ``--world-size`` ranks;

then compares with the device's memory and recommends what to change, in the guides' order.
The model is built on the meta device, so a model larger than the machine can be planned.

One module per concern: ``static`` (byte rules), ``activations`` (the meta-device
measurement), ``sharding`` (ZeRO/FSDP arithmetic), ``budget`` (``Plan``, ``plan_job``),
``advice`` (recommendations) and ``render``; the command line (a config -> ``build_plan``, and
``python -m looplib.plan``) is ``looplib.cli.plan``. Every name here stays importable from
``looplib.plan``.
"""
from __future__ import annotations

from ..activations import ActivationCheckpointing, Checkpointing
from .activations import (STRATEGIES, Activations, ActivationUse, FusedAttention, MetaAutocast, Saved,
                          activation_estimates, activation_uses, chosen_modules, default_checkpointing, measure_saved,
                          meta_batch, strategy_bytes)
from .advice import engine_choice, human, largest_micro_batch, recommendations
from .budget import USABLE, Plan, device_memory, plan_job
from .render import render, row
from .sharding import fsdp_per_rank, fsdp_units, zero_per_rank
from .static import (BNB_BLOCK, BNB_QMAP, MATMUL_MODULES, adam8bit_rule, autocast_copy_bytes, gradient_bytes, nbytes,
                     optimizer_state_bytes, optimizer_state_bytes_of, state_rule, state_tensor_bytes, unique_params,
                     weight_bytes)

__all__ = ["BNB_BLOCK", "BNB_QMAP", "MATMUL_MODULES", "STRATEGIES", "USABLE", "ActivationCheckpointing",
           "ActivationUse", "Activations", "activation_uses", "chosen_modules", "strategy_bytes",
           "Checkpointing", "FusedAttention", "MetaAutocast", "Plan", "Saved", "activation_estimates",
           "adam8bit_rule", "autocast_copy_bytes", "default_checkpointing", "device_memory",
           "engine_choice", "fsdp_per_rank", "fsdp_units", "gradient_bytes", "human", "largest_micro_batch",
           "measure_saved", "meta_batch", "nbytes", "plan_job", "optimizer_state_bytes", "optimizer_state_bytes_of",
           "recommendations", "render", "row", "state_rule", "state_tensor_bytes", "unique_params", "weight_bytes",
           "zero_per_rank"]
