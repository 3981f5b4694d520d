"""DeepSpeed's JSON config as looplib derives it: the keys looplib owns, the precision's sections, and
the one place deepspeed itself is imported (when the engine is chosen, never before)."""
from __future__ import annotations

import logging
import math
from typing import Literal, get_args

import torch

from ...errors import ConfigError, need

Offload = Literal["none", "cpu", "nvme"]
OFFLOAD_DEVICES = get_args(Offload)

# Raw DeepSpeed keys that looplib derives: setting them in engine.config would make two
# sources of truth, so they are refused with the looplib setting to use instead.
DERIVED = {
    "train_micro_batch_size_per_gpu": "batch_size (the micro-batch per process)",
    "train_batch_size": "batch_size and accum_steps (global batch = batch_size x accum_steps x processes)",
    "gradient_accumulation_steps": "accum_steps",
    "gradient_clipping": "max_grad_norm",
    "managed_gradient_accumulation": "nothing: the loop owns the accumulation boundary",
    "optimizer": "+optim=... (e.g. +optim=cpu_adam for DeepSpeed's CPU Adam)",
    "scheduler": "+schedule=...",
    "amp": "+precision=...",
    "zero_optimization.stage": "engine.stage",
    "zero_optimization.offload_optimizer.device": "engine.offload_optimizer",
    "zero_optimization.offload_param.device": "engine.offload_params",
}


def import_deepspeed():
    deepspeed = need("deepspeed", "deepspeed", "engine", "+engine=deepspeed",
                     "DS_BUILD_OPS=0 pip install deepspeed (builds no kernels ahead of time)")
    from packaging.version import Version
    if Version(deepspeed.__version__).release < (0, 19, 4):
        raise ConfigError("engine", f"deepspeed {deepspeed.__version__} cannot leave the accumulation boundary "
                          "to the loop (managed_gradient_accumulation arrived in 0.19.4)",
                          "pip install 'deepspeed>=0.19.4'")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines would drown the loop's
    return deepspeed


def lookup(cfg: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def precision_sections(precision) -> dict:
    """bf16/fp16 sections from the precision strategy (by its dtype, so subclasses map too)."""
    dtype = precision.dtype
    if dtype == torch.bfloat16:
        return {"bf16": {"enabled": True}}
    if dtype != torch.float16:
        return {}  # fp32, tf32: no section, fp32 weights
    args = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
            **getattr(precision, "scaler_args", {})}
    power = math.log2(args["init_scale"])
    if args["growth_factor"] != 2.0 or args["backoff_factor"] != 0.5 or power != int(power):
        raise ConfigError("precision", f"DeepSpeed's loss scaler doubles and halves a power of two, not "
                          f"init_scale={args['init_scale']} growth_factor={args['growth_factor']} "
                          f"backoff_factor={args['backoff_factor']}",
                          "use precision.init_scale=65536 growth_factor=2 backoff_factor=0.5 under DeepSpeed")
    return {"fp16": {"enabled": True, "loss_scale": 0,            # 0: dynamic
                     "initial_scale_power": int(power),
                     "loss_scale_window": args["growth_interval"],
                     "hysteresis": 1,                           # back off on every overflow, as GradScaler
                     "min_loss_scale": 1}}
