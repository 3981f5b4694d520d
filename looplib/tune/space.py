"""What can be varied, for this job on this device, as the overrides a user would type.

A candidate is one choice per dimension; its overrides are appended to the job's. A dimension
the job pinned on its command line is never varied, and ``precision``/``optim``/``peft`` (which
change the numbers) only with ``tune.numerics=allow``. ``plan`` prices a candidate with the memory
planner (``looplib.plan``) before anything runs.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .settings import DIMENSIONS, NUMERICS, Tune


@dataclass(frozen=True)
class Candidate:
    """One configuration: a choice per dimension that differs from the job as given."""
    choice: tuple[tuple[str, str], ...] = ()     # ((dimension, option), ...), sorted
    micro_batch: int = 0                         # 0: the job's own
    accum_steps: int = 0

    def get(self, dim: str, default: str | None = None) -> str | None:
        return dict(self.choice).get(dim, default)

    def with_(self, **changes) -> "Candidate":
        choice = dict(self.choice)
        micro, accum = self.micro_batch, self.accum_steps
        for dim, option in changes.items():
            if dim == "batch":
                micro, accum = option
            elif option is None:
                choice.pop(dim, None)
            else:
                choice[dim] = option
        return Candidate(tuple(sorted(choice.items())), micro, accum)

    @property
    def changes_numerics(self) -> bool:
        return any(dim in NUMERICS for dim, _ in self.choice)

    def label(self) -> str:
        parts = ([f"{self.micro_batch}x{self.accum_steps}"] if self.micro_batch else []) + [f"{d}={o}" for d, o in self.choice]
        return " ".join(parts) or "as given"


@dataclass
class Space:
    """The options of each dimension, for this job and device."""
    per_rank: int                                 # sequences per optimizer step on each rank
    job_batch: tuple[int, int]                    # the job's (micro-batch, accumulation)
    options: dict[str, list[str]] = field(default_factory=dict)   # dimension -> options (the job's first)
    resets_global_batch: bool = False             # the job set global_batch_size: candidates set it null

    def overrides(self, c: Candidate) -> list[str]:
        """The command-line overrides of a candidate (appended to the job's)."""
        out = []
        if c.micro_batch:
            out += [f"batch_size={c.micro_batch}", f"accum_steps={c.accum_steps}"]
            out += ["global_batch_size=null"] if self.resets_global_batch else []
        for dim, option in c.choice:
            out += OVERRIDES[dim](option, c)
        return out

    def micro_batches(self) -> list[int]:
        """Divisors of the per-rank batch, largest first (the likely fastest)."""
        return [d for d in range(self.per_rank, 0, -1) if self.per_rank % d == 0]


def _engine(option: str, c: Candidate) -> list[str]:
    if option in ("ddp", "fsdp"):
        return [f"+engine={option}"]
    if option == "fsdp_offload":
        return ["+engine=fsdp", "engine.offload=cpu"]
    stage, _, offload = option.removeprefix("zero").partition("_")
    out = ["+engine=deepspeed", f"engine.stage={stage}"]
    return out + (["engine.offload_optimizer=cpu", "+optim=cpu_adam"] if offload else [])


OVERRIDES = {
    "checkpointing": lambda o, c: [] if o == "none" else [f"+checkpointing={o}"],
    "compile": lambda o, c: [] if o == "none" else [f"+compile={o}"],
    "loss": lambda o, c: [f"loss={o}"],
    # the kernel of the job's AdamW; another optimizer (the optim dimension) has its own
    "optim_impl": lambda o, c: [f"+optim.impl={o}"] if c.get("optim", "adamw") == "adamw" else [],
    "engine": _engine,
    "precision": lambda o, c: [f"+precision={o}"],
    "optim": lambda o, c: [f"+optim={o}"],
    "peft": lambda o, c: [] if o == "none" else [f"+peft={o}"],
}


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def device_options(device: torch.device, world: int, loss_target: str) -> dict[str, list[str]]:
    """Every option of every dimension this device (and world size, and installed packages) runs."""
    cuda = device.type == "cuda"
    # offload's speed is the CUDA copy engines'; on the CPU (host memory is the device's) only its mechanics
    options = {"checkpointing": ["none", "blocks", "selective", "offload"],
               "compile": ["none", "default", "max_autotune", "reduce_overhead"] if cuda else ["none", "default"],
               "optim_impl": ["fused", "foreach"] if cuda else ["foreach", "fused"]}
    if loss_target.endswith("TokenCrossEntropy") or loss_target.endswith(".CausalLMLoss"):
        options["loss"] = ["lm", "lm_chunked"]
    if world > 1:
        engines = ["ddp", "fsdp"] + (["fsdp_offload"] if cuda else [])
        if has("deepspeed"):
            engines += ["zero1", "zero2", "zero3"] + (["zero2_offload", "zero3_offload"] if cuda else [])
        options["engine"] = engines
    precisions = ["fp32", "bf16"]
    if cuda:
        precisions = ["fp32", "tf32"] + (["bf16"] if torch.cuda.is_bf16_supported() else []) + ["fp16"]
        if torch.cuda.get_device_capability(device) >= (8, 9) and has("torchao"):
            precisions.append("fp8")
    options["precision"] = precisions
    # muon: fewer steps to a loss, not faster steps; tune measures and checks it like the others
    options["optim"] = ["adamw", "adafactor", "muon"] + (["adam8bit"] if cuda and has("bitsandbytes") else [])
    if "loss" in options and has("peft") and has("bitsandbytes"):  # a language model: QLoRA's 4-bit base
        options["peft"] = ["none", "qlora"]
    return options


def build_space(tune: Tune, job: list[str], settings, device: torch.device, world: int, loss_target: str,
                pinned: set[str], trained_base: bool = True) -> Space:
    """The dimensions searched: those the device runs, less the pinned ones, restricted by
    ``tune.search`` and ``tune.options``. ``trained_base``: False for a model that starts from
    random weights, whose job no adapter (QLoRA) may train (``looplib.peft``)."""
    if settings.batch_size == "auto":
        global_batch = settings.global_batch_size
        job_batch = (0, 0)
    else:
        global_batch = settings.batch_size * settings.accum_steps * world
        job_batch = (settings.batch_size, settings.accum_steps)
    if global_batch % world:
        raise ConfigError("global_batch_size", f"the global batch {global_batch} does not split over {world} processes",
                          f"use a multiple of {world}")
    space = Space(global_batch // world, job_batch, resets_global_batch=settings.global_batch_size is not None)
    available = device_options(device, world, loss_target)
    if not trained_base:
        available.pop("peft", None)  # adapters on a random base: refused by the run (peft.allow_random_base)
    wanted = list(tune.search) if tune.search is not None else [d for d in DIMENSIONS if d in available or d == "batch"]
    for dim in wanted:
        if dim in pinned or (dim == "optim_impl" and "optim" in pinned) or (dim in NUMERICS and tune.numerics != "allow"):
            continue
        if dim == "batch":
            space.options["batch"] = [str(b) for b in space.micro_batches()]
            continue
        if dim not in available:
            continue
        chosen = available[dim]
        if dim in tune.options:
            unknown = [o for o in tune.options[dim] if o not in chosen]
            if unknown:
                raise ConfigError(f"tune.options.{dim}", f"{unknown[0]!r} is not an option of {dim} here "
                                  f"(this device and world size run {', '.join(chosen)})",
                                  f"choose among {', '.join(chosen)}")
            chosen = [chosen[0]] + [o for o in tune.options[dim] if o != chosen[0]]
        space.options[dim] = chosen
    for dim in tune.options:
        if dim not in space.options:
            why = ("pinned on the command line" if dim in pinned else "not searched (tune.search)" if dim not in wanted
                   else "searched only with tune.numerics=allow" if dim in NUMERICS and tune.numerics != "allow"
                   else "not available for a model that starts from random weights (give model.init_from or "
                   "model.path)" if dim == "peft" and not trained_base
                   else "not available here (engines need several processes: torchrun)")
            raise ConfigError(f"tune.options.{dim}", f"{dim} is {why}", f"drop tune.options.{dim}")
    return space
