"""One assembly: the strategy objects of a job -> a ready run.

Every way in builds the same run through this module:

    python -m looplib.train ...      Hydra instantiates the config groups (looplib.cli), then this
    train_model(model, data, ...)    the same objects given in Python (looplib.run.api), then this
    batch_size=auto, looplib.tune    probe and measure through the same pieces

``check(parts, settings)`` makes the checks that need no data and no model, and chooses the
precision for the engine (once: nothing changes it later). ``build(parts, settings, record)``
checks the data against the model and sets up, in the order the command line always used: the
adapter, the precision's conversion, activation checkpointing, the engine's setup,
``batch_size=auto``, compile. ``looplib.run.training.train`` then trains what ``build``
returns; ``looplib.run.session.Session`` owns the whole of a run's life around both.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.identity import Expected
from ..errors import ConfigError
from ..groups import groups
from ..train_state import TrainState
from . import autobatch, rules, teacher
from ..store.checkpoint_dir import config_text
from ..store.resume import check_reference
from .settings import Settings


@dataclass
class Parts:
    """The objects of one job, one typed field per config group (``looplib.groups.GROUPS``; a test
    holds the two equal: a group of one's own adds its row there and its field here). One left out
    is its group's null object, made from the job's settings at ``check``. ``model`` and ``data``
    may be a ``Recipe``: built by the session once every cheap check has passed (the command line's:
    nothing is tokenised for a run that is refused)."""
    model: Any = None                 # nn.Module (or its Recipe)
    data: Any = None                  # looplib.data.Corpus (or its Recipe)
    checkpointing: Any = None         # looplib.Checkpointing: activation memory
    compile: Any = None               # looplib.Compile
    objective: Any = None             # group ``loss``: any object with __call__(model, batch) and count(batch)
    engine: Any = None                # looplib.Engine
    precision: Any = None             # looplib.Precision
    optim: Any = None                 # looplib.OptimizerFactory
    schedule: Any = None              # looplib.Schedule
    peft: Any = None                  # looplib.FullModel (LoRA, QLoRA)
    evaluation: Any = None            # looplib.Evaluation
    logger: Any = None                # looplib.loggers.Logger (several: Loggers)
    reward: Any = None                # looplib.reward: reward(prompts, completions, records) -> list[float]
    more: dict[str, Any] = field(default_factory=dict)  # the groups appended to GROUPS at run time, by part

    @classmethod
    def of(cls, **given: Any) -> "Parts":
        """The parts by their names: a field each, or a group appended to ``GROUPS`` (in ``more``)."""
        known = {g.part for g in groups()}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(f"Parts() got {', '.join(unknown)}, which no config group holds "
                            f"(looplib.groups.GROUPS: {', '.join(sorted(known))})")
        typed = {f.name for f in fields(Parts)} - {"more"}
        return cls(**{k: v for k, v in given.items() if k in typed},
                   more={k: v for k, v in given.items() if k not in typed})

    def get(self, part: str) -> Any:
        return getattr(self, part) if part in self.__dataclass_fields__ and part != "more" else self.more.get(part)

    def fill(self, settings: Settings) -> None:
        """Each part not given: its group's null object (the plain-PyTorch default)."""
        for row in groups():
            if self.get(row.part) is None and row.null is not None:
                if row.part in self.__dataclass_fields__:
                    setattr(self, row.part, row.null(settings))
                else:
                    self.more[row.part] = row.null(settings)


class Recipe:
    """A part that is built only once every cheap check has passed (the command line's data and
    model: ``looplib.cli.main.GroupRecipe``). ``build()`` returns the object."""

    def build(self, expected: Expected | None = None) -> Any:
        """``expected``: the identity of the checkpoint a resume will continue from (None: none),
        for data that compare themselves with it as they are built (``looplib.data.identity``)."""
        raise NotImplementedError


@dataclass
class Record:
    """What a run says about itself: the config saved as config.yaml and in every checkpoint
    (compared on resume), sent to trackers as hyperparameters."""
    config: dict                       # plain values; YAML only on disk (checkpoint_dir.config_text)
    name: str = ""                     # trackers' run name ("": the run directory's name)
    group: str | None = None           # a sweep's directory (trackers group its jobs)
    resume_hint: str = "resume=auto"   # how to continue, said after a signal ({run_dir} is filled in)
    origins: dict[str, str] = field(default_factory=dict)  # group -> " (Class, from group=option)"

    @property
    def text(self) -> str:
        return config_text(self.config)


@dataclass
class Job(Parts):
    """A built run: the parts after ``build`` (model set up on the engine, adapters, compile),
    with the settings and the record."""
    settings: Settings | None = None
    record: Record | None = None
    model_name: str = ""                              # the user's model, before anything wraps it
    counts: tuple[int, int, int] | None = None        # parameters: every one, trained, in 4 bits

    @classmethod
    def of(cls, parts: Parts, settings: Settings, record: Record) -> "Job":
        return cls(**{f.name: getattr(parts, f.name) for f in fields(Parts)}, settings=settings, record=record)


@dataclass
class JobSpec:
    """One job, typed: what the command line (``looplib.cli.main.job_spec``) and ``train_model`` each
    build, and what ``looplib.run.session.Session`` runs."""
    parts: Parts
    settings: Settings
    record: Record
    init_from: str | None = None   # a finished run's weights, loaded into the model once it is built


@dataclass
class Trained:
    model: nn.Module                 # on the device; wrapped by the engine, compile, or peft when chosen
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state: TrainState                # ``state.preempted``: stopped by a signal, after saving
    eval_loss: float | None          # on the held-out data after the last step (None without any)
    run_dir: Path | None = None      # None: no run directory (train_model without run_dir)
    last_row: dict = field(default_factory=dict)  # the last value of every metric logged


@contextmanager
def refused(group: str, record: Record):
    """A library's ``ValueError``/``TypeError`` while building ``group``'s object becomes the one
    line naming the group (and the option that chose its class)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(group, f"{group}{record.origins.get(group, '')} was refused: {reason}",
                          f"check the {group} settings") from None


def model_name(model: nn.Module) -> str:
    """The model as the user chose it: its class, and the transformers class inside looplib's
    wrapper (``CausalLM (LlamaForCausalLM)``)."""
    inner = getattr(model, "hf", None)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # QLoRA loads its base into peft
    return f"{type(model).__name__} ({type(inner).__name__})" if isinstance(inner, nn.Module) else type(model).__name__


def check(parts: Parts, settings: Settings) -> None:
    """The rules between strategies that need no data and no model (so bad input fails before a
    tokenizer is trained or a model is built; ``looplib.run.rules``), once the absent parts are
    their null objects and the precision is the one chosen for the engine (FSDP's sharded loss
    scaler, DeepSpeed's own scaling: once, here; nothing replaces it later)."""
    parts.fill(settings)
    parts.precision = parts.engine.precision_for(parts.precision)
    rules.ask("parts", parts, settings)


def build(parts: Parts, settings: Settings, record: Record, expected: Expected | None = None) -> Job:
    """Check the data against the model and set the parts up (``check`` has passed).
    ``batch_size=auto`` is resolved here: ``settings`` and ``record`` then hold the chosen
    micro-batch and accumulation. ``expected``: the identity of the checkpoint a resume will take
    (``looplib.store.resume.expected_identity``): a changed teacher or reference is refused here."""
    engine = parts.engine
    rules.ask("built", parts, settings)  # the data against the model, the objective and the adapter
    teacher.check_resumed(parts.objective, expected)  # loss=distill resumed: the checkpoint's teacher, or refused
    name = model_name(parts.model)  # the user's model, before anything wraps it (peft, FSDP2's FSDPGPT, compile)
    model = parts.checkpointing.apply(parts.precision.convert(parts.peft.wrap(parts.model)))  # fp8: Float8Linear
    job = Job.of(parts, settings, record)
    job.model_name = name
    job.counts = parameter_counts(model)  # as the user's model defines them, before any engine shards it
    keep = getattr(job.objective, "keep_before_sharding", None)  # a frozen copy, taken while the weights are whole
    if keep is not None and not getattr(engine, "keeps_modules", True):
        keep(model)
    job.model = engine.setup(model)
    attach = getattr(job.objective, "attach", None)  # an objective that keeps the starting model (DPO's reference)
    if attach is not None:  # before a resumed checkpoint is loaded, and before batch_size=auto probes memory
        attach(job.model, engine)
        check_reference(getattr(job.objective, "identity", None), expected)  # a resume whose reference changed
    prepare = getattr(job.objective, "prepare", None)  # loss.reference=precomputed: the pass over every pair, once
    if prepare is not None:
        prepare(job.model, job.data, engine, job.precision,
                settings.batch_size if isinstance(settings.batch_size, int) else 1)
    if settings.batch_size == "auto":  # the largest micro-batch that fits, then accumulation
        # probed eager, before compiling: probing a compiled model with several batch sizes would
        # leave it a dynamic-shape graph (slower kernels) for the size finally chosen
        from ..plan import optimizer_state_bytes  # the planner only when asked
        settings.batch_size, settings.accum_steps = autobatch.resolve(job, optimizer_state_bytes(job, default=0))
        record.config.update(batch_size=settings.batch_size, accum_steps=settings.accum_steps)
        rules.ask("chosen", job, settings)  # the rules on the micro-batch and accumulation, now chosen
    job.model = job.compile.wrap(job.model)  # compile last: it sees the final module
    job.objective = job.compile.wrap_loss(job.objective)  # compile.loss=true: forward + loss, one graph
    return job


def parameter_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """(every parameter, those trained, those held in 4 bits) as the model defines them, whatever
    holds them (counted before the engine shards it: under FSDP2 a packed 4-bit shard no longer
    knows its shape, so ``build`` counts first; one process and two gave 0.16M and 0.09M): a 4-bit
    weight counted at its shape, not its packed bytes (bitsandbytes' ``quant_state``); a ZeRO-3
    partition at its whole size (``ds_numel``); an FSDP2 shard at its global size (a DTensor)."""
    total = trained = four_bit = 0
    for p in model.parameters():
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n = getattr(p, "ds_numel", None) or (int(torch.Size(shape).numel()) if shape is not None else p.numel())
        total += n
        trained += n if p.requires_grad else 0
        four_bit += n if shape is not None else 0
    return total, trained, four_bit
