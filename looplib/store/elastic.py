"""What a resumed run may change about the processes it runs on, decided before anything is built.

A checkpoint records its geometry (``meta.json``: the engine, how it stores model and optimizer
state, the number of processes, ``batch_size``, ``accum_steps``) and its data position in
samples of the epoch's permutation. A resume with the same command on another number of
processes (torchrun restarting on the nodes that are left, a job given fewer or more GPUs):

- keeps the global batch (batch_size x accum_steps x processes) by choosing the accumulation:
  the micro-batch as typed when it divides the global batch per process, else the largest one
  below it that does (not checked against the memory plan: a smaller micro-batch than the one
  typed needs less activation memory, but fewer processes hold larger ZeRO/FSDP shards);
- continues at the same sample of the same permutation (``looplib.data.Epochs.restore``), with
  the same RNG state, schedule and step;
- may switch between the local engine, DDP and FSDP2 (their checkpoints load into each other:
  ``looplib.store.state_dicts``); DeepSpeed's ZeRO partitions load only into DeepSpeed (on
  another number of processes through its universal checkpoint);
- says in one line what changed. A global batch the new processes cannot split is refused
  (``ConfigError``) naming the process counts that can, before the data, model or engine exist.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger("looplib")

TORCH_FORMATS = ("looplib", "dcp")  # the local engine, DDP and FSDP read each other's checkpoints


@dataclass(frozen=True)
class Geometry:
    """How a run splits its global batch over processes, and how its engine stores state."""
    engine: str        # the +engine= option: local, ddp, fsdp, deepspeed (a class of one's own: its name)
    format: str        # looplib, dcp or deepspeed (Engine.checkpoint_format)
    world_size: int
    batch_size: int
    accum_steps: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size * self.accum_steps

    def as_dict(self) -> dict:
        return {**asdict(self), "global_batch": self.global_batch}


def current(engine, batch_size: int, accum_steps: int) -> Geometry:
    return Geometry(engine.label, engine.checkpoint_format, engine.world_size, batch_size, accum_steps)


def damaged(meta: dict) -> str | None:
    """What is wrong with the geometry record of a checkpoint's ``meta.json`` (None: nothing, or
    no record: a checkpoint written before looplib recorded it)."""
    if "geometry" not in meta:
        return None
    g = meta["geometry"]
    if not isinstance(g, dict):
        return f"it is {type(g).__name__} {g!r}, not a record"
    missing = [k for k in ("engine", "format", "world_size", "batch_size", "accum_steps") if k not in g]
    if missing:
        return "it lacks " + ", ".join(missing)
    for key in ("engine", "format"):
        if not isinstance(g[key], str) or not g[key]:
            return f"{key} is {g[key]!r}, not a name"
    for key in ("world_size", "batch_size", "accum_steps"):
        if not isinstance(g[key], int) or isinstance(g[key], bool) or g[key] < 1:
            return f"{key} is {g[key]!r}, not a whole number of at least 1"
    if "global_batch" in g and g["global_batch"] != g["world_size"] * g["batch_size"] * g["accum_steps"]:
        return (f"global_batch is {g['global_batch']!r}, not world_size x batch_size x accum_steps = "
                f"{g['world_size'] * g['batch_size'] * g['accum_steps']}")
    return None


def saved_geometry(path: Path, meta: dict, config: dict, world_now: int) -> Geometry:
    """The geometry a checkpoint was written with (``meta.json``; for a checkpoint written before
    looplib recorded it: from its files and config, its world size FSDP's ``fsdp.json`` or the
    number of DeepSpeed's partitions, else taken as this run's). A damaged record is refused in
    one line naming the file (``inspect_checkpoint`` finds it first, for every checkpoint)."""
    why = damaged(meta)
    if why:
        raise ConfigError("resume", f"{Path(path) / 'meta.json'}: its geometry record is damaged ({why})",
                          "resume from another checkpoint (resume=PATH), or start a new run")
    if isinstance(meta.get("geometry"), dict):
        g = meta["geometry"]
        return Geometry(g["engine"], g["format"], g["world_size"], g["batch_size"], g["accum_steps"])
    path = Path(path)
    target = str((config.get("engine") or {}).get("_target_") or "looplib.engines.Engine")
    name = target.rsplit(".", 1)[-1]
    engine = "local" if name in ("Engine", "Local") else name.lower()
    world = world_now
    if (path / "shards").is_dir():
        fmt = "dcp"
        if (path / "fsdp.json").is_file():
            world = json.loads((path / "fsdp.json").read_text())["world_size"]
    elif (path / "state.pt").is_file():
        fmt = "looplib"
    else:
        fmt = "deepspeed"
        world = len(list(path.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))) or world_now
    return Geometry(engine, fmt, world, config.get("batch_size"), config.get("accum_steps"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split(saved: Geometry, world: int, batch_size: int, accum_steps: int) -> tuple[int, int]:
    """The (batch_size, accum_steps) this run uses on ``world`` processes to keep the checkpoint's
    global batch: as typed when it keeps it; else, when the accumulation is the checkpoint's (the
    same command), the micro-batch as typed if it divides the global batch per process, or the
    largest one below it that does, and the accumulation that makes up the rest."""
    total = saved.global_batch
    if world * batch_size * accum_steps == total:
        return batch_size, accum_steps
    if total % world:
        raise ConfigError("resume", f"the checkpoint's global batch of {total} sequences ({saved.world_size} "
                          f"process(es) x batch_size={saved.batch_size} x accum_steps={saved.accum_steps}) cannot be "
                          f"split over {world} processes", f"resume on {counts(total)} processes, or start a new run")
    per_process = total // world
    if accum_steps != saved.accum_steps:  # typed anew: the user chose the split, and it changes the global batch
        raise ConfigError("resume", f"{world} process(es) x batch_size={batch_size} x accum_steps={accum_steps} = "
                          f"{world * batch_size * accum_steps} sequences per step, but the checkpoint's global batch "
                          f"is {total}", f"choose batch_size x accum_steps = {per_process} per process, or leave "
                          f"accum_steps={saved.accum_steps} as the checkpoint had it and looplib chooses it")
    micro = max(d for d in divisors(per_process) if d <= batch_size)
    return micro, per_process // micro


def counts(total: int) -> str:
    """The process counts that split ``total`` evenly, as a phrase: ``1, 2, 4 or 8``."""
    return listed(divisors(total))


def listed(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:-1])) + f" or {numbers[-1]}" if len(numbers) > 1 else str(numbers[0])


def what_changed(saved: Geometry, now: Geometry) -> str:
    """One line: ``2 -> 1 processes: accum_steps 1 -> 2, global batch 16 kept`` (empty: nothing)."""
    head = []
    if saved.world_size != now.world_size:
        head.append(f"{saved.world_size} -> {now.world_size} processes")
    if saved.engine != now.engine:
        head.append(f"engine {saved.engine} -> {now.engine}")
    tail = [f"{key} {a} -> {b}" for key, a, b in (("batch_size", saved.batch_size, now.batch_size),
                                                   ("accum_steps", saved.accum_steps, now.accum_steps)) if a != b]
    if not head and not tail:
        return ""
    tail.append(f"global batch {now.global_batch} kept")
    return (", ".join(head) + ": " if head else "") + ", ".join(tail)


def check_engine(saved: Geometry, engine, config: dict | None = None) -> None:
    """A switch of engine the checkpoint's format allows, or a refusal (before any engine is set up).
    A 4-bit base (``+peft=qlora``, from the checkpoint's ``config``) is stored as its engine holds
    it: packed into uint8 by the local engine and DDP, into FSDP's float shards: no switch between them."""
    fmt, label = engine.checkpoint_format, engine.label
    if saved.format in TORCH_FORMATS and fmt in TORCH_FORMATS and saved.format != fmt and four_bit(config):
        raise ConfigError("resume", f"the checkpoint holds a 4-bit base (+peft=qlora) as +engine={saved.engine} "
                          f"packs it ({'float shards' if saved.format == 'dcp' else 'uint8, whole'}), which "
                          f"+engine={label} cannot load", f"resume with +engine={saved.engine} (on any number of "
                          "processes), or start a new run")
    if saved.format == fmt or (saved.format in TORCH_FORMATS and fmt in TORCH_FORMATS):
        return
    if saved.format == "deepspeed":
        raise ConfigError("resume", f"the checkpoint holds DeepSpeed's ZeRO partitions (+engine=deepspeed), which "
                          f"+engine={label} cannot load", "resume with +engine=deepspeed (on any number of processes), "
                          "or start a new run")
    raise ConfigError("resume", f"the checkpoint was written by +engine={saved.engine} (whole tensors or "
                      f"torch.distributed.checkpoint shards), which +engine={label} cannot load",
                      f"resume with +engine=ddp, +engine=fsdp or +engine=local, or start a new run")


def four_bit(config: dict | None) -> bool:
    """Whether a checkpoint's config trained LoRA on a 4-bit base (``looplib.peft.QLoRA`` or a subclass)."""
    import pydoc
    target = str(((config or {}).get("peft") or {}).get("_target_") or "")
    if not target:
        return False
    from ..peft import QLoRA
    cls = pydoc.locate(target)
    return isinstance(cls, type) and issubclass(cls, QLoRA)


def accept(saved: Geometry, now: Geometry, saved_cfg: dict, now_cfg: dict) -> None:
    """Make ``saved_cfg`` agree with ``now_cfg`` where the change keeps what the run computes (the
    split of the same global batch, a switch between the local engine, DDP and FSDP), so that
    the config check that follows sees only other changes. Refuses another global batch."""
    if saved.engine != now.engine and "engine" in now_cfg:
        saved_cfg["engine"] = now_cfg["engine"]  # another engine: its own keys (checked above: a switch that loads)
    known = (saved.batch_size, saved.accum_steps, now.batch_size, now.accum_steps)
    if not all(isinstance(n, int) for n in known):  # a config without them (a test's): compared as it is
        return
    if saved.global_batch != now.global_batch:
        raise ConfigError("batch_size", f"the checkpoint was made by {saved.world_size} process(es) x batch_size="
                          f"{saved.batch_size} x accum_steps={saved.accum_steps} (global batch {saved.global_batch}); "
                          f"{now.world_size} x {now.batch_size} x {now.accum_steps} = {now.global_batch} would change "
                          "what the resumed run computes",
                          f"choose batch_size x accum_steps = {saved.global_batch // now.world_size} per process"
                          if saved.global_batch % now.world_size == 0 else
                          f"resume on {counts(saved.global_batch)} processes")
    for key in ("batch_size", "accum_steps"):
        if key in now_cfg:
            saved_cfg[key] = now_cfg[key]


def check_epoch_end(meta: dict, now: Geometry, max_steps: int) -> None:
    """Epochs hold the samples the first run's processes could split evenly (``epoch_samples``);
    processes that cannot split that number would train the end of each epoch on other samples.
    Refused when the run reaches an epoch's end; a run that stops before it is exact."""
    keep, samples = meta.get("epoch_samples"), meta.get("samples")
    if keep is None or samples is None or keep % now.world_size == 0:
        return
    last = meta["step"] + -(-(keep - samples) // now.global_batch)  # the step that ends this epoch
    if max_steps < last:
        return
    works = [d for d in divisors(now.global_batch) if keep % d == 0]
    raise ConfigError("resume", f"the checkpoint's epochs hold {keep} samples, which {now.world_size} processes "
                      f"cannot split evenly: from step {last} on, each epoch's end would train on other samples than "
                      "the run this checkpoint comes from", f"resume on {listed(works)} processes, or "
                      f"stop before the epoch's end (max_steps={last - 1})")
