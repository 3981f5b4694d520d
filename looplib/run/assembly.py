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
returns; ``looplib.run.lifecycle.execute`` owns the whole of a run's life around both.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ConfigError
from ..groups import groups
from ..loss import TokenCrossEntropy, refuse_unshifted
from ..train_state import TrainState
from . import autobatch
from .checkpoint_dir import config_text
from .resume import check_reference
from .settings import Settings


class Parts:
    """The objects of one job, one per config group (``looplib.groups.GROUPS``: ``model``, ``data``,
    ``objective`` (group loss), ``precision``, ``optim``, ``schedule``, ``engine``, ``peft``, ``compile``,
    ``evaluation``, ``checkpointing``, ``logger``). One left out is its group's null object, made
    from the job's settings at ``check``. ``later``: builds parts only once the cheap checks have
    passed (the command line's data and model: nothing is tokenised for a run that is refused)."""

    def __init__(self, later: Callable[[], dict[str, Any]] | None = None, **given: Any):
        known = {g.part for g in groups()}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(f"Parts() got {', '.join(unknown)}, which no config group holds "
                            f"(looplib.groups.GROUPS: {', '.join(sorted(known))})")
        for row in groups():
            setattr(self, row.part, given.get(row.part))
        self.later = later or dict

    def build_later(self) -> None:
        for part, value in self.later().items():
            setattr(self, part, value)

    def fill(self, settings: Settings) -> None:
        """Each part not given: its group's null object (the plain-PyTorch default)."""
        for row in groups():
            if getattr(self, row.part, None) is None and row.null is not None:
                setattr(self, row.part, row.null(settings))


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


class Job(Parts):
    """A built run: the parts after ``build`` (model set up on the engine, adapters, compile),
    with the settings and the record."""

    def __init__(self, parts: Parts, settings: Settings, record: Record):
        vars(self).update(vars(parts))
        self.settings, self.record = settings, record


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


def check_sequences_fit(corpus: Any, model: Any) -> None:
    """A training sample longer than the model's ``seq_len`` would fail in the first forward pass
    (position embeddings run out): refuse it now. Models and data without these are not asked."""
    limit = getattr(model, "seq_len", None)
    try:
        length = corpus.train[0]["input_ids"].shape[-1] if len(corpus.train) else 0
    except (AttributeError, IndexError, KeyError, TypeError):
        return
    if isinstance(limit, int) and length > limit:
        raise ConfigError("data.seq_len", f"the data's sequences hold {length} tokens, more than model.seq_len={limit}",
                          "leave data.seq_len as ${model.seq_len}, or make model.seq_len at least as long")


def check_labels(corpus: Any, objective: Any, samples: int = 8) -> None:
    """Labels in the Hugging Face convention (unshifted) would train a copier: refused on the first
    training samples, before anything is written (``looplib.loss.refuse_unshifted``; every batch is
    checked again as it is counted). Data whose samples are not dicts of ids is not asked."""
    if not isinstance(objective, TokenCrossEntropy):
        return
    try:
        first = [corpus.train[i] for i in range(min(samples, len(corpus.train)))]
    except (AttributeError, IndexError, KeyError, TypeError, NotImplementedError):
        return
    for sample in first:
        if isinstance(sample, dict) and "labels" in sample and "input_ids" in sample:
            try:
                ids, labels = torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["labels"])
            except (TypeError, ValueError, RuntimeError):
                return
            positions = sample.get("position_ids")
            refuse_unshifted(ids, labels, objective.ignore_index,
                             torch.as_tensor(positions) if positions is not None else None)


def check_pairs(corpus: Any, objective: Any) -> None:
    """A preference objective (``loss=dpo``) needs data of pairs, and pairs need such an objective:
    any other would train on the rejected completions as on the chosen ones."""
    wants, has = getattr(objective, "pairs", False), getattr(corpus, "pairs", False)
    if wants and not has:
        raise ConfigError("data", f"the loss ({type(objective).__name__}) trains on pairs of completions (chosen "
                          f"and rejected), and the data ({type(corpus).__name__}) hold none",
                          "use data=preference data.path=PAIRS.jsonl (records with prompt, chosen and rejected)")
    if has and not wants:
        raise ConfigError("loss", f"data=preference holds pairs, and the loss ({type(objective).__name__}) would "
                          "train on the rejected completions as on the chosen ones",
                          "use loss=dpo, loss=simpo or loss=orpo")


def model_name(model: nn.Module) -> str:
    """The model as the user chose it: its class, and the transformers class inside looplib's
    wrapper (``CausalLM (LlamaForCausalLM)``)."""
    inner = getattr(model, "hf", None)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # QLoRA loads its base into peft
    return f"{type(model).__name__} ({type(inner).__name__})" if isinstance(inner, nn.Module) else type(model).__name__


def check(parts: Parts, settings: Settings) -> None:
    """The checks between strategies that need no data and no model (so bad input fails before a
    tokenizer is trained or a model is built): the precision on the engine's device, chosen for
    that engine (FSDP's sharded loss scaler, DeepSpeed's own scaling), the engine with the
    precision and optimizer, the held-out evaluation, activation checkpointing with the engine and
    compile mode, the adapter with the engine and precision."""
    parts.fill(settings)
    engine = parts.engine
    parts.precision = engine.precision_for(parts.precision)  # once, here: nothing replaces it later
    engine.check(settings, parts.precision, parts.optim)
    engine.check_evaluation(parts.evaluation)
    parts.checkpointing.check(engine, parts.compile)  # offload: not under CUDA graphs
    parts.compile.check_optimizer(parts.optim, engine.device)  # compile.optimizer=true: not fused kernels
    if settings.batch_size != "auto":  # auto's accumulation is checked once chosen (build)
        parts.compile.check_accumulation(settings.accum_steps)  # CUDA graphs: one backward per step
    schedule_check = getattr(parts.schedule, "check", None)  # a warm-up as long as the run: refused
    if schedule_check is not None:
        schedule_check(settings.max_steps)
    parts.peft.check(engine, parts.precision)  # QLoRA: an engine that keeps the 4-bit base, a compute dtype it takes
    optim_check = getattr(parts.optim, "check", None)  # an optimizer may refuse an adapter (Muon: LoRA)
    if optim_check is not None:
        optim_check(engine, parts.peft)


def build(parts: Parts, settings: Settings, record: Record) -> Job:
    """Check the data against the model and set the parts up (``check`` has passed).
    ``batch_size=auto`` is resolved here: ``settings`` and ``record`` then hold the chosen
    micro-batch and accumulation."""
    engine = parts.engine
    parts.compile.check(parts.data)  # CUDA graphs: fixed shapes only
    check_data = getattr(parts.model, "check_data", None)  # a model may check the data (looplib.hf)
    if check_data is not None:
        check_data(parts.data)
    check_sequences_fit(parts.data, parts.model)
    check_pairs(parts.data, parts.objective)
    check_labels(parts.data, parts.objective)
    check_base = getattr(parts.peft, "check_base", None)  # LoRA on a model never trained: refused unless said
    if check_base is not None:
        check_base(parts.model)
    name = model_name(parts.model)  # the user's model, before anything wraps it (peft, FSDP2's FSDPGPT, compile)
    model = parts.checkpointing.apply(parts.precision.convert(parts.peft.wrap(parts.model)))  # fp8: Float8Linear
    job = Job(parts, settings, record)
    job.model_name = name
    job.counts = parameter_counts(model)  # as the user's model defines them, before any engine shards it
    job.model = engine.setup(model)
    attach = getattr(job.objective, "attach", None)  # an objective that keeps the starting model (DPO's reference)
    if attach is not None:  # before a resumed checkpoint is loaded, and before batch_size=auto probes memory
        attach(job.model, engine)
        check_reference(getattr(job.objective, "identity", None))  # a resume whose reference changed: refused now
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
        job.compile.check_accumulation(settings.accum_steps)
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
