"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer
state sharded over ranks, each transformer block gathered only while it computes.

    torchrun --nproc_per_node 4 -m looplib.train +engine=fsdp
    torchrun --nproc_per_node 4 -m looplib.train +engine=fsdp +precision=bf16 engine.offload=cpu

Who does what:
- ``fully_shard`` goes on every transformer block (found by class name or a name pattern, as
  activation checkpointing finds them: ``engine.blocks``, ``engine.block_names``) and then on
  the root, which holds what is left (embeddings, final norm, head). A block's parameters are
  all-gathered just before its forward and backward and freed after
  (``engine.reshard_after_forward=false`` keeps them between forward and backward: faster,
  more memory). Parameters become ``DTensor`` shards; the optimizer steps on the shards;
- the precision strategy maps onto ``MixedPrecisionPolicy``: bf16/fp16 parameters for
  compute, gradients reduce-scattered in fp32 (``engine.reduce_dtype=param``: in 16 bits,
  half the traffic). fp16's loss scaler becomes ``ShardedGradScaler``, whose inf/NaN check
  is agreed across ranks (one all-reduce), so every rank skips the same steps;
- the loop keeps the accumulation boundary: gradients are reduce-scattered only on the
  window's last micro-batch (``set_requires_gradient_sync``); the window's item count is summed
  over ranks as under DDP (FSDP averages gradients over ranks, as DDP does);
- clipping runs on the sharded gradients: ``clip_grad_norm_`` returns the global norm;
- checkpoints are sharded (``checkpoint_format = "dcp"``: torch.distributed.checkpoint, every
  rank writes its own shards, in parallel; written and read by ``looplib.store.formats.Sharded``),
  and load onto any number of processes, under FSDP or as whole tensors under DDP or the local
  engine (``looplib.store.state_dicts``; which changes a resume accepts: ``looplib.store.elastic``);
- the final weights are gathered into ``model.safetensors`` on rank 0's CPU, one parameter
  at a time from the other ranks' point of view (no rank but 0 ever holds the whole model).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..optim import built_class
from ..precision import Precision
from ..process.group import start
from ..schema import Positive
from .distributed import Distributed, class_name

log = logging.getLogger("looplib")


# Optimizers that cannot step on DTensor shards, with the reason (module prefix or dotted class).
REFUSED_OPTIMIZERS = {
    "bitsandbytes": ("bitsandbytes' 8-bit optimizers keep quantised state per whole tensor and run their "
                     "kernels on plain tensors, not DTensor shards",
                     "use +optim=adamw (FSDP already divides its state by the number of processes), or +engine=deepspeed"),
    "deepspeed.ops.adam.DeepSpeedCPUAdam": ("DeepSpeed's CPU Adam steps DeepSpeed's flat partitions, not "
                                            "DTensor shards", "use +optim=adamw with engine.offload=cpu "
                                            "(the optimizer then steps on the CPU), or +engine=deepspeed"),
    class_name(torch.optim.Adafactor): ("torch's Adafactor scales each step by the parameter's norm with "
                                        "in-place ops that DTensor cannot run on a norm of shards "
                                        "(aten.pow_ on a partial norm, torch 2.13)",
                                        "use +optim=adamw or +optim=sgd, or +engine=ddp / +engine=deepspeed"),
}

# looplib's Block and the usual Hugging Face decoder/encoder layers (as +checkpointing=blocks)
BLOCKS = ["Block", "GPT2Block", "BertLayer", "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"]

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class FSDP(Distributed):
    """``fully_shard`` on every transformer block and on the root; gloo on the CPU, NCCL on CUDA.

    blocks / block_names: the modules sharded as units (class names, or a regular expression
    over qualified names). reshard_after_forward: free gathered parameters after each block's
    forward (ZeRO-3 behaviour; false: keep them until backward, ZeRO-2-like). offload: ``cpu``
    keeps the shards, gradients and optimizer state in host memory (the optimizer steps on the
    CPU). reduce_dtype: ``float32`` (default) or ``param`` (the 16-bit compute dtype).
    """

    keeps_modules = False  # parameters become DTensor shards
    shards_4bit = True     # a 4-bit base (+peft=qlora) too: its packed weights in a float dtype (looplib.peft.QLoRA)

    checkpoint_format = "dcp"  # sharded: torch.distributed.checkpoint, every rank its own file
    several_processes = True  # one rank of several (torchrun, deepspeed, SLURM)
    passes_before_training = True  # a forward without gradients before training leaves the shards as they were

    def __init__(self, device: str | torch.device = "auto", blocks: list[str] | None = BLOCKS,
                 block_names: str | None = None, reshard_after_forward: bool = True,
                 offload: Literal["none", "cpu"] = "none", reduce_dtype: Literal["float32", "param"] = "float32",
                 timeout_s: Positive[float] = 1800):
        from ..activations import ActivationCheckpointing
        super().__init__(device, timeout_s)
        if offload not in ("none", "cpu"):
            raise ConfigError("engine.offload", f"{offload!r} is not an offload device",
                              "use engine.offload=none or cpu")
        if reduce_dtype not in ("float32", "param"):
            raise ConfigError("engine.reduce_dtype", f"{reduce_dtype!r} is not a reduce dtype",
                              "use engine.reduce_dtype=float32 or param")
        if not blocks and not block_names:
            raise ConfigError("engine.blocks", "neither engine.blocks nor engine.block_names is set",
                              "name block classes (engine.blocks=[Block]) or a pattern "
                              "(engine.block_names='blocks\\.\\d+')")
        try:
            self.finder = ActivationCheckpointing(types=list(blocks or ()), names=block_names)
        except ConfigError as err:  # a bad regular expression: its key is engine.block_names here
            raise ConfigError("engine.block_names", err.problem, err.fix) from None
        self.reshard_after_forward, self.offload, self.reduce_dtype = reshard_after_forward, offload, reduce_dtype
        self.mp_policy = None  # from the precision, in check (or setup)

    # ---------------------------------------------------------------- build time

    def check(self, settings, precision, optim=None) -> None:
        self.mp_policy = self.policy(precision)
        if self.offload == "cpu" and self.device.type == "cpu":
            raise ConfigError("engine.offload", "engine.offload=cpu moves shards from the device to host memory, "
                              "but the device is already the CPU", "use engine.offload=none on the CPU")
        if optim is None:
            return
        cls = "deepspeed.ops.adam.DeepSpeedCPUAdam" if type(optim).__name__ == "CPUAdam" \
            else class_name(built_class(optim))
        if self.offload == "cpu" and getattr(optim, "gathers_matrices", False):
            raise ConfigError("engine.offload", "+optim=muon gathers each matrix's update across ranks for "
                              "Newton-Schulz, which the device's collectives cannot do for shards offloaded to "
                              "host memory", "use engine.offload=none with +optim=muon, or +optim=adamw")
        for prefix, (why, fix) in REFUSED_OPTIMIZERS.items():
            if cls == prefix or cls.startswith(prefix + "."):
                raise ConfigError("optim", f"+engine=fsdp with {cls.rsplit('.', 1)[-1]}: {why}", fix)

    def check_evaluation(self, evaluation) -> None:
        if getattr(evaluation, "casts_weights", False):  # a strategy is any callable: the flag is optional
            raise ConfigError("evaluation", "+evaluation=bf16/fp16 casts each parameter's .data, but FSDP gathers "
                              "blocks from its own flat shard buffers (the cast is not seen, and under inference "
                              "mode the gather fails)", "leave +evaluation out: with +precision=bf16 FSDP already "
                              "evaluates with bf16 parameters")

    def policy(self, precision):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        dtype = precision.dtype
        if dtype not in DTYPES:  # fp32, tf32: fp32 parameters, fp32 reduction
            return MixedPrecisionPolicy()
        reduce = torch.float32 if self.reduce_dtype == "float32" else dtype
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)

    # ---------------------------------------------------------------- the engine verbs

    def setup(self, model: nn.Module) -> nn.Module:
        """Shard every block, then the root, before the optimizer is built (it steps on the shards)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method
        start(self)
        units = [m for _, m in self.finder.chosen(model)]
        unit_class = type(units[0]).__name__ if units else "-"
        if not units:
            log.warning("FSDP: no module matches engine.blocks / engine.block_names: the whole model is one "
                        "unit, gathered whole on every rank (parameters gain nothing from sharding)")
        mp_policy = self.mp_policy or self.policy(Precision())
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.offload == "cpu" else OffloadPolicy()
        # The model stays where it was built (the CPU): fully_shard moves one unit at a time to
        # the mesh's device and shards it there, so no rank ever holds the whole model on the
        # device (with offload the shards go back to host memory). The mesh names the device
        # type: FSDP's default would pick CUDA whenever present, even for device=cpu.
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        args = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                    reshard_after_forward=self.reshard_after_forward)
        for unit in units:
            fully_shard(unit, **args)
        # the root's parameters (embeddings, head) are needed first in backward: resharding them
        # after forward would only gather them again at once (torchtitan does the same)
        fully_shard(model, **{**args, "reshard_after_forward": False})
        resharded_outside_training(model)
        if callable(getattr(model, "generate", None)):  # a wrapper's generate (peft) calls the inner
            register_fsdp_forward_method(model, "generate")  # model directly: gather the root's shards first
        self.units = len(units) + 1
        log.info("FSDP: %d processes, backend %s, %s each; %d units (%d x %s and the root); parameters in "
                 "%s, gradients reduced in %s%s", self.world_size, dist.get_backend(), self.device, self.units,
                 len(units), unit_class, mp_policy.param_dtype or "fp32", mp_policy.reduce_dtype or "fp32",
                 "; shards offloaded to the CPU" if self.offload == "cpu" else "")
        return model

    def place_frozen(self, module: nn.Module, cast: bool = True) -> nn.Module:
        """A frozen model beside the trained one (DPO's reference copy, a distillation teacher):
        sharded with the same units and mesh, computing in the policy's precision (``cast=False``:
        in its own dtype), every unit resharded after its forward (there is no backward), no
        gradients, in eval mode. Every rank runs its forward in lockstep, as the policy's."""
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        module.requires_grad_(False).eval()
        args = dict(mesh=init_device_mesh(self.device.type, (self.world_size,)),
                    mp_policy=(self.mp_policy or self.policy(Precision())) if cast else MixedPrecisionPolicy(),
                    reshard_after_forward=True)
        for _, unit in self.finder.chosen(module):
            fully_shard(unit, **args)
        fully_shard(module, **args)
        resharded_outside_training(module)
        return module

    def precision_for(self, precision):
        if hasattr(precision, "sharded"):  # fp8: its weights may be gathered in fp8 (precision.fsdp_all_gather)
            precision.sharded = True
        if hasattr(precision, "scaler_class"):  # fp16: inf/NaN agreed across ranks
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            precision.scaler_class = ShardedGradScaler
        return super().precision_for(precision)

    def accumulating(self, model: nn.Module, last: bool):
        model.set_requires_gradient_sync(last)  # every unit: reduce-scatter on the window's last only
        return nullcontext()

    # ---------------------------------------------------------------- weights

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole state dict, fp32 shards gathered one tensor at a time onto rank 0's CPU
        (the other ranks get an empty dict and never hold more than one unsharded tensor).
        Tied names map to one tensor, as in the local engine's file. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not full:
            return {}
        first: dict[int, str] = {}  # tied parameters: one tensor under every name, stored once
        for name, p in model.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), name)
            full[name] = full[first[id(p)]]
        return full


def resharded_outside_training(model: nn.Module) -> None:
    """Hooks on the root that leave every unit sharded after a forward without gradients.

    In training, each unit is gathered for its forward and resharded by its backward (the root,
    kept gathered after forward, in backward). A forward without gradients (an evaluation, a
    DPO reference pass, GRPO's sampling) has no backward: the root, and under
    ``engine.reshard_after_forward=false`` every block, stayed gathered, and
    ``model.parameters()`` then yielded the gathered tensors, not the shards. An optimizer built
    then (a pass before training) stepped on them: the root never trained, its step wrote into
    freed storage, and the run ended in a segfault. So such a forward reshards every unit (one
    more gather of the root per forward without gradients).

    The units' gathered tensors are allocated on the first forward; under inference mode they
    would be inference tensors, which training's gathers then cannot write: a first forward under
    inference mode (an evaluation before training) gathers and reshards once outside it first."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    first = [True]

    def before(module, args):
        if first[0]:
            first[0] = False
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False):
                    for unit in units:
                        unit.unshard()
                    for unit in units:
                        unit.reshard()

    def after(module, args, output):
        if not torch.is_grad_enabled():
            for unit in units:
                unit.reshard()

    model.register_forward_pre_hook(before, prepend=True)  # before FSDP's own (its root's lazy init)
    model.register_forward_hook(after)  # after FSDP's own post-forward
