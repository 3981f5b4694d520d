"""The plan of one job: what ``python -m looplib.train <overrides>`` would hold, from its parts
(``looplib.cli.plan.build_plan`` builds them from a config)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .. import optim as lo
from .activations import Activations, ActivationUse, activation_uses, chosen_modules
from .sharding import Sharded4bit, fsdp_per_rank, fsdp_units, sharded_4bit
from .static import adam8bit_rule, autocast_copy_bytes, gradient_bytes, optimizer_state_bytes_of, unique_params, weight_bytes

USABLE = 0.9  # share of device memory a plan may fill (CUDA context, allocator fragmentation)


@dataclass
class Plan:
    model_name: str
    n_params: int                                  # parameters that train (LoRA: the adapter's)
    precision: str
    optimizer: str
    micro_batch: int | str
    accum_steps: int
    global_batch: int | None
    weights: int
    copies: int
    gradients: int
    optim_state: int
    act_plain: ActivationUse                       # without activation checkpointing
    act_ckpt: ActivationUse                        # with the configured strategy (blocks when none is)
    checkpointing_on: bool
    chosen: list[str]
    memory: int
    memory_name: str
    world: int
    adam8bit_state: int | None = None
    act_plain_bf16: ActivationUse | None = None
    fsdp_unit: tuple[str, int] = ("the root", 0)   # the largest unit FSDP gathers: (name, bytes)
    n_total: int = 0                               # all parameters, frozen ones included (0: n_params)
    uses: dict[str, ActivationUse] = field(default_factory=dict)  # every strategy: none, blocks, selective, offload
    strategy: str = "none"                         # the configured one
    copies_freed: int = 0                          # 16-bit copies the configured strategy does not hold into backward
    four_bit: bool = False                         # a 4-bit base (+peft=qlora): FSDP shards it, DeepSpeed refuses it
    sharded4: Sharded4bit | None = None            # its layout under FSDP2 (four_bit only)
    engine: str = "local"                          # the configured engine (+engine=...)
    reference: int = 0                             # loss=dpo's frozen copy of the weights (full fine-tuning)
    reference_kind: str = ""                       # how loss=dpo keeps its reference ("": no reference)
    reference_of: str = "DPO reference"            # whose frozen weights (loss=distill: the teacher's)

    def fsdp(self, offload: bool = False) -> int:
        """Per rank under FSDP2: fp32 parameters, gradients and optimizer state sharded (the
        16-bit copies exist only for the gathered unit)."""
        return fsdp_per_rank(self.weights + self.gradients + self.optim_state, self.fsdp_unit[1], self.world, offload)

    def fsdp_4bit(self, world: int | None = None, use: ActivationUse | None = None) -> dict[str, int]:
        """Per rank under FSDP2 with the 4-bit base sharded (``Sharded4bit.per_rank``), the optimizer
        state as the adapters' share, what is gathered at once (``Sharded4bit.gathered``), the
        activations of ``use`` (default: the configured strategy) at the micro-batch, and the peak:
        all of it at once, at the start of backward.
        The 16-bit copies autocast makes are not counted: under FSDP's mixed precision the gathered
        parameters are in the compute dtype already."""
        world = world or self.world
        out = self.sharded4.per_rank(world)
        total = self.sharded4.per_rank(1)["adapters"]
        out["optimizer"] = -(-self.optim_state * out["adapters"] // total) if total else 0
        out["gathered"] = self.sharded4.gathered
        mb = self.micro_batch if isinstance(self.micro_batch, int) else 1
        out["activations"] = (use or self.activations).at(mb)
        out["peak"] = sum(out[k] for k in ("packed", "constants", "frozen", "adapters", "gradients", "optimizer",
                                           "gathered", "activations"))
        return out

    @property
    def static(self) -> int:
        return self.weights + self.reference + self.copies + self.gradients + self.optim_state

    @property
    def activations(self) -> ActivationUse:
        return self.act_ckpt if self.checkpointing_on else self.act_plain

    @property
    def host(self) -> Activations:
        """Activations in host memory (``+checkpointing=offload``; zero otherwise)."""
        return self.activations.host

    def peak(self, micro_batch: int) -> int:
        """The step's peak. The loop frees gradients after each update (set_to_none), so without
        accumulation a forward pass ends with none allocated: activations (end of forward, start
        of backward) and gradients (end of backward) take turns on top of weights, 16-bit copies
        and optimizer state. With accumulation the gradients live through the later forward
        passes too. Activations peak either at the end of forward (every 16-bit copy still in
        autocast's cache) or early in backward (the loss's backward, or a recomputed module, on
        top of what is saved; the copies inside checkpointed modules freed by then).
        (bert_large on an H100: within 2.2% of the allocator's peak in every row of the guides'
        table; GPT-2 small at 8 x 1024 tokens on an H200: within 1.1% in every activation
        strategy's row, and QLoRA on a Llama-3-8B shape 0.5% under, where before the loss's
        backward was counted they were 35-47% and 11% under.)"""
        use = self.activations
        kept = self.copies - (self.copies_freed if self.checkpointing_on else 0)
        act = max(self.copies + use.device.at(micro_batch), kept + use.at(micro_batch))
        held = self.weights + self.reference + self.optim_state
        return held + (self.gradients + act if self.accum_steps > 1 else max(self.copies + self.gradients, act))

    def zero_layout(self) -> tuple[int, int, int]:
        """DeepSpeed's model state: 16-bit params and grads with an fp32 master copy in the
        optimizer when mixed, fp32 params and grads otherwise. Frozen parameters (LoRA's base)
        have a 16-bit copy only: no gradient, no master copy."""
        if self.copies:
            return 2 * (self.n_total or self.n_params), 2 * self.n_params, 4 * self.n_params + self.optim_state
        return self.weights, self.gradients, self.optim_state


def plan_job(settings, precision, factory, checkpointing, objective, peft, make_model, data_seq_len: int | None,
             blocks: list[str] | None = None, world: int = 1, memory: int | None = None) -> Plan:
    """The plan of a job from its parts (``make_model()`` is called on the meta device: no memory)."""
    from ..engines.fsdp import BLOCKS
    from ..engines.local import resolve_device

    with torch.device("meta"):
        model = make_model()
        model_name = type(model).__name__
        model = peft.wrap(model)  # LoRA: only the adapter's parameters train (gradients, optimizer state)
    dtype = precision.dtype
    seq_len = int(getattr(model, "seq_len", None) or data_seq_len)
    chosen, keep, kind = chosen_modules(model, checkpointing)
    uses = activation_uses(model, objective, seq_len, dtype, chosen, keep)
    plain, ckpt = uses["none"], uses["blocks" if kind == "none" else kind]
    device = resolve_device(settings.device)
    if memory is None:
        memory, name = device_memory(device)
    else:
        name = "given"
    n = sum(p.numel() for p in unique_params(model, trainable=True))
    plan = Plan(model_name, n, precision.name,
                type(factory).__name__, settings.batch_size, settings.accum_steps, settings.global_batch_size,
                weight_bytes(model), autocast_copy_bytes(model, dtype), gradient_bytes(model),
                optimizer_state_bytes_of(factory, model), plain, ckpt, kind != "none", chosen, memory, name, world,
                uses=uses, strategy=kind)
    name, count = max(fsdp_units(model, blocks or BLOCKS), key=lambda u: u[1])
    plan.n_total = sum(p.numel() for p in unique_params(model))
    from ..quantize import is_4bit
    plan.four_bit = any(is_4bit(m) for m in model.modules())
    if plan.four_bit:
        plan.sharded4 = sharded_4bit(model, blocks or BLOCKS, dtype)
    plan.fsdp_unit = (name, count * (2 if dtype in (torch.bfloat16, torch.float16) else 4))
    if chosen and dtype is not None:
        plan.copies_freed = autocast_copy_bytes(model, dtype, chosen)
        uses["offload"].host.fixed += plan.copies_freed  # offload packs them to host memory with the rest
    if not isinstance(factory, lo.Adam8bit):
        plan.adam8bit_state = adam8bit_rule(model)
    plan.reference, plan.reference_kind = reference_bytes(objective, model)
    if hasattr(objective, "unread"):  # loss=distill: the teacher, frozen, beside the student
        plan.reference, plan.reference_kind = teacher_bytes(objective)
        plan.reference_of = "distillation teacher"
    if dtype is None:
        plan.act_plain_bf16 = activation_uses(model, objective, seq_len, torch.bfloat16, chosen, ())["none"]
    return plan


def reference_bytes(objective, model) -> tuple[int, str]:
    """``loss=dpo``'s reference (``looplib.preference.DPO.attach``): full fine-tuning with
    ``loss.reference=live`` keeps a frozen copy of every weight, in its dtype (``weight_bytes``
    again); under ``+peft`` the adapters are switched off and ``precomputed`` keeps no model: none."""
    mode = getattr(objective, "mode", None) if hasattr(objective, "attach") else None
    if mode is None:
        return 0, ""
    if mode == "precomputed":
        return 0, "precomputed log-probabilities (no copy)"
    if any("lora_" in name for name, _ in model.named_parameters()):
        return 0, "the adapters switched off (no copy)"
    return weight_bytes(model), "a frozen copy of the weights"


def teacher_bytes(objective) -> tuple[int, str]:
    """``loss=distill``'s teacher as the run holds it (``looplib.distill.Distill.take``): every
    weight and buffer cast to ``loss.teacher_dtype``. A teacher not read yet is counted from its
    files' headers (safetensors: names, dtypes, shapes; no weight read)."""
    dtype = objective.dtype
    if objective.teacher is not None:
        tensors = held_tensors(objective.teacher)
    else:
        tensors = stored_tensors(objective.path)
    size = sum(n * (torch.empty((), dtype=dtype).element_size() if d.is_floating_point else d.itemsize)
               for n, d in tensors)
    return size, f"{objective.path or 'the module given'} in {str(dtype).removeprefix('torch.')}"


def stored_tensors(path) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of every tensor of the teacher at ``path`` (``looplib.run.teacher``), from
    its safetensors files' headers: a transformers directory (or a run's ``hf/`` export), else a
    finished run's model.safetensors."""
    from pathlib import Path

    from ..errors import ConfigError
    where = Path(path).expanduser()
    exported = next((d for d in (where / "hf", where) if (d / "config.json").is_file()), None)
    files = sorted(exported.glob("*.safetensors")) if exported is not None else \
        [f for f in [where / "model.safetensors"] if f.is_file()]
    if not files:
        raise ConfigError("loss.teacher", f"the planner counts the teacher from its safetensors files, and {where} "
                          "holds none (a teacher read from a checkpoint)", "plan with the teacher's exported run "
                          "(its model.safetensors), or plan the student alone with loss=lm_chunked")
    from safetensors import safe_open
    out = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                numel = 1
                for d in part.get_shape():
                    numel *= d
                out.append((numel, SAFETENSORS_DTYPES[part.get_dtype()]))
    return out


def held_tensors(module: torch.nn.Module) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of every parameter and buffer of ``module``, tied ones once."""
    return [(t.numel(), t.dtype) for t in [*module.parameters(), *module.buffers()]]


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def device_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, props.name
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"
