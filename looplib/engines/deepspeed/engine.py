"""The ``DeepSpeed`` engine: build-time checks, the derived config and ``deepspeed.initialize``
(the package's docstring says who does what; its checkpoints: ``checkpoints.ZeroCheckpoints``)."""
from __future__ import annotations

import json
import logging
import os
from contextlib import nullcontext
from typing import Any, Literal

import torch
from torch import nn

from ...errors import ConfigError
from ...muon import MuonAdamW
from ...optim import built_class
from ...precision import Precision
from ...schema import Positive
from ...process.group import start
from ..distributed import Distributed, class_name
from ..local import Prepared
from . import muon as ds_muon
from .checkpoints import ZeroCheckpoints
from .config import DERIVED, OFFLOAD_DEVICES, Offload, import_deepspeed, lookup, merge, precision_sections
from .optim import CPUAdam, StepHooks
from .precision import DeepSpeedPrecision

log = logging.getLogger("looplib")


class DeepSpeed(Distributed):
    """``deepspeed.initialize`` with a config derived from looplib's settings.

    stage: ZeRO stage 0-3 (1: optimizer state partitioned over ranks, 2: and gradients,
    3: and parameters). offload_optimizer / offload_params: none, cpu or nvme (nvme needs
    ``nvme_path``; parameter offload needs stage 3; optimizer offload needs an optimizer that
    runs on the CPU, ``+optim=cpu_adam``). config: extra raw DeepSpeed keys, merged last.
    """

    checkpoint_format = "deepspeed"  # DeepSpeed's own: ZeRO partitions per rank (ZeroCheckpoints, set here)
    keeps_modules = False  # ZeRO partitions and re-types parameters
    several_processes = True  # one rank of several (torchrun, deepspeed, SLURM)

    def __init__(self, device: str | torch.device = "auto", stage: Literal[0, 1, 2, 3] = 2, offload_optimizer: Offload = "none",
                 offload_params: Offload = "none", nvme_path: str | None = None, config: dict | None = None,
                 timeout_s: Positive[float] = 1800):
        super().__init__(device, timeout_s)
        self.stage, self.offload_optimizer, self.offload_params = stage, offload_optimizer, offload_params
        self.nvme_path, self.raw = nvme_path, dict(config or {})
        self._check_own_keys()
        self.ds = None            # the DeepSpeedEngine, once prepared
        self.steps = None         # the optimizer as the loop sees it (StepHooks), once prepared
        self.chosen = None        # the loop's precision on this engine (DeepSpeedPrecision), from precision_for
        self.derived: dict = {}
        self.checkpoints = ZeroCheckpoints(self)  # its own format: looplib.store.formats takes it as it is
        self.muon = False         # +optim=muon: DeepSpeed's own Muon (ds_muon)

    # ---------------------------------------------------------------- build-time checks

    def _check_own_keys(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError("engine.stage", f"ZeRO stage {self.stage!r} does not exist", "use engine.stage=0, 1, 2 or 3")
        for key, value in (("offload_optimizer", self.offload_optimizer), ("offload_params", self.offload_params)):
            if value not in OFFLOAD_DEVICES:
                raise ConfigError(f"engine.{key}", f"{value!r} is not an offload device", f"use engine.{key}=none, cpu or nvme")
        if self.offload_params != "none" and self.stage != 3:
            raise ConfigError("engine.offload_params", f"parameter offload needs ZeRO stage 3 (got engine.stage={self.stage})",
                              "use engine.stage=3, or engine.offload_params=none")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ConfigError("engine.offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3 (got engine.stage=0)",
                              "use engine.stage=2 (or 1, 3), or engine.offload_optimizer=none")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ConfigError("engine.nvme_path", "offload to nvme needs a directory on an NVMe drive",
                              "set engine.nvme_path=/local_nvme/ds_offload")
        for dotted, instead in DERIVED.items():
            if lookup(self.raw, dotted) is not None:
                raise ConfigError(f"engine.config.{dotted}", "looplib derives this DeepSpeed key from its own settings",
                                  f"remove it and set {instead}")

    def check(self, settings, precision, optim=None) -> None:
        if getattr(getattr(settings, "checkpoint", None), "asynchronous", False):
            raise ConfigError("checkpoint.async", "+engine=deepspeed writes its ZeRO partitions itself, synchronously "
                              "(looplib cannot stage them off the device to write in the background)",
                              "drop checkpoint.async=true with +engine=deepspeed, or use +engine=fsdp for sharded "
                              "checkpoints written in the background")
        if os.environ.setdefault("DS_ACCELERATOR", self.device.type) != self.device.type:
            raise ConfigError("device", f"device={self.device} but DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}",
                              "unset DS_ACCELERATOR or make it match device")
        deepspeed = import_deepspeed()
        accelerator = deepspeed.get_accelerator()
        if accelerator.device_name() != self.device.type:
            raise ConfigError("device", f"device={self.device} but DeepSpeed's accelerator is "
                              f"{accelerator.device_name()} (deepspeed was imported before looplib chose)",
                              "set DS_ACCELERATOR to match device, or device=auto")
        self.derived = self.derive(settings, precision)
        enabled = [k for k in ("fp16", "bf16") if lookup(self.derived, f"{k}.enabled")]
        if len(enabled) == 2:
            raise ConfigError("engine.config", "fp16 and bf16 are both enabled",
                              "choose one precision with +precision=fp16 or +precision=bf16 and drop "
                              "engine.config.fp16/bf16.enabled")
        wanted = [k for k in ("fp16", "bf16") if k in precision_sections(precision)]
        if enabled != wanted:
            raise ConfigError("engine.config", f"engine.config enables {enabled[0]} but the precision is "
                              f"{getattr(precision, 'name', type(precision).__name__)}",
                              f"use +precision={enabled[0]} and drop engine.config.{enabled[0]}.enabled")
        if "fp16" in enabled and not accelerator.is_fp16_supported():
            raise ConfigError("precision", f"DeepSpeed's {accelerator.device_name()} accelerator has no fp16",
                              "use +precision=bf16 or +precision=fp32")
        if getattr(optim, "gathers_matrices", False):  # +optim=muon: DeepSpeed's own Muon (ds_muon)
            ds_muon.check(optim, self, settings)
        elif optim is not None:  # a factory: the class it builds says where it runs
            built = CPUAdam.CLASS if isinstance(optim, CPUAdam) else class_name(built_class(optim))
            self._check_optimizer(built)

    def _check_optimizer(self, built: str) -> None:
        """Optimizer offload runs the optimizer step on the CPU: the optimizer must run there."""
        package, name = built.split(".")[0], built.split(".")[-1]
        cpu_adam = name == "DeepSpeedCPUAdam"
        if self.offload_optimizer != "none":
            if package == "bitsandbytes":
                raise ConfigError("optim", f"{name} is an 8-bit GPU optimizer, but optimizer offload runs the "
                                  "optimizer on the CPU", "use +optim=cpu_adam (DeepSpeed's CPU Adam), or "
                                  "engine.offload_optimizer=none")
            if not cpu_adam and self.derived.get("zero_force_ds_cpu_optimizer", True):
                raise ConfigError("optim", f"optimizer offload with {package}'s {name}: DeepSpeed expects its CPU "
                                  "Adam there", "use +optim=cpu_adam, or allow a slow torch optimizer with "
                                  "+engine.config.zero_force_ds_cpu_optimizer=false")
        elif cpu_adam and self.device.type != "cpu":
            raise ConfigError("optim", "+optim=cpu_adam steps on the CPU, but without optimizer offload the "
                              f"optimizer state lives on {self.device}", "add engine.offload_optimizer=cpu, "
                              "or choose +optim=adamw")

    # ---------------------------------------------------------------- the derived config

    def derive(self, settings, precision, world_size: int = 1) -> dict:
        zero: dict[str, Any] = {"stage": self.stage}
        for key, device in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_params)):
            if device != "none":
                zero[key] = {"device": device, **({"nvme_path": self.nvme_path} if device == "nvme" else {}),
                             **({"pin_memory": True} if self.device.type == "cuda" else {})}
        derived = {
            "train_micro_batch_size_per_gpu": settings.batch_size,
            "gradient_accumulation_steps": settings.accum_steps,
            "train_batch_size": settings.batch_size * settings.accum_steps * world_size,
            "managed_gradient_accumulation": False,         # the loop's step() is the boundary
            "gradient_clipping": float(settings.max_grad_norm or 0.0),  # DeepSpeed would clip at 1.0
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,          # the optimizer is built by looplib's optim group
            "steps_per_print": 2**31 - 1,                   # looplib's telemetry reports progress
            **precision_sections(precision),
            **({"checkpoint": {"load_universal": True}} if self.checkpoints.universal else {}),
        }
        return merge(derived, self.raw)

    # ---------------------------------------------------------------- the engine verbs

    def setup(self, model: nn.Module) -> nn.Module:
        start(self)
        return model.to(self.device)  # so the optimizer is built on device tensors (fused kernels)

    def precision_for(self, precision):
        """DeepSpeed scales, unscales, clips and steps: the loop's precision hands its verbs to the
        ``DeepSpeedEngine`` (``prepare`` makes it), from the chosen one's dtype and scaler settings."""
        if not isinstance(precision, DeepSpeedPrecision):
            self.chosen = DeepSpeedPrecision(super().precision_for(precision))
        return self.chosen

    def prepare(self, model: nn.Module, optimizer, settings) -> Prepared:
        deepspeed = import_deepspeed()
        if self.chosen is None:  # used without the assembly: fp32
            self.precision_for(Precision())
        if not self.derived:  # used without the assembly's build-time check
            self.check(settings, self.chosen, None)
            self._check_optimizer(class_name(type(optimizer)))
        config = self.derive(settings, self.chosen, self.world_size)
        self.muon = isinstance(optimizer, MuonAdamW)  # DeepSpeed builds its own Muon from looplib's groups
        given = {"optimizer": optimizer}
        if self.muon:
            config["optimizer"], groups = ds_muon.prepare(model, optimizer)
            if self.stage == 3:  # ZeRO-3's Muon orthogonalises whole matrices: all-reduce, not reduce-scatter
                config["zero_optimization"]["reduce_scatter"] = False
            given = {"model_parameters": groups}
        log.info("DeepSpeed config derived from looplib's settings:\n%s", json.dumps(config, indent=2))
        self.ds, built, _, _ = deepspeed.initialize(model=model, config=config, **given)
        if self.muon:
            ds_muon.adopt(optimizer, built)
        self.steps = StepHooks(optimizer)
        self.chosen.attach(self.ds, self.steps)  # from here on the loop's precision calls DeepSpeed's verbs
        return Prepared(self.ds, self.steps, None)

    def accumulating(self, model, last: bool):
        # ZeRO 0/1 reduce in step(); ZeRO 2/3 reduce-scatter each micro-batch's gradients into
        # their partitions by design. Either way the loop has nothing to switch off.
        return nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    # ---------------------------------------------------------------- weights

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter whole and in fp32 (the optimizer's master copy under ZeRO and mixed
        precision), on the CPU. Collective: every rank calls it; ZeRO-3 gathers the partitions."""
        from deepspeed.utils import safe_get_full_fp32_param
        module = self.unwrap(model)
        whole = {}
        for p in module.parameters():  # same order on every rank
            full = safe_get_full_fp32_param(p)
            whole[id(p)] = (p.detach() if full is None else full).to("cpu", torch.float32, copy=True)
        # tied names map to the same tensor, so safetensors stores them once, as save_model does
        return {name: whole[id(t)] if id(t) in whole else t.detach().to("cpu", copy=True)
                for name, t in module.state_dict(keep_vars=True).items()}
