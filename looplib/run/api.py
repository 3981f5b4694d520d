"""The command line without Hydra: ``train_model`` builds and runs exactly what ``python -m
looplib.train`` builds and runs (``looplib.run.session``), from Python objects.

    from looplib import BF16, AdamW, train_model
    result = train_model(MyModel(), my_dataset, max_steps=1000, batch_size=8, accum_steps=4,
                         precision=BF16(), optim=AdamW(lr=3e-4, weight_decay=0.1), run_dir="runs/first")

Every strategy argument is the object a config group builds (``conf/<group>/*.yaml`` names its
class and arguments); one left out is that group's plain-PyTorch default. The other keyword
arguments are the command line's settings, checked by the same rules (one ``ConfigError``
line on a bad value). Nothing here imports Hydra or OmegaConf.

``run_dir=PATH`` writes what a CLI run writes: metrics.jsonl, config.yaml (the settings and
the class of every part), checkpoints/ (every ``checkpoint_every`` steps and at the end, the
newest ``keep`` kept), the exported weights; ``resume="auto"`` (or a checkpoint path)
continues a run. SIGTERM/SIGUSR1 and Ctrl-C save at the next step boundary as on the command
line, then raise ``Interrupted`` (``.status`` 75 or 130, ``.result`` the ``Trained`` so far);
a run with too many non-finite steps raises ``NumericError``, a failed save ``SaveError``: every
ending is a ``looplib.RunEnded`` with the ``status`` the command line would exit with.
Without ``run_dir`` nothing is written but ``metrics=PATH``, which starts afresh (a warning
says so when it held an earlier run's rows): it never appends.

It speaks like the CLI: a progress bar on a terminal, progress lines otherwise (through the
``looplib`` logger; when the caller has configured no logging at all, a handler printing
INFO lines to stderr is added). ``logger=`` takes the same trackers as ``+logger=``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from torch import nn
from torch.utils.data import Dataset

from ..activations import Checkpointing
from ..compile import Compile
from ..data import Corpus
from ..engines import Engine
from ..process import this
from ..errors import ConfigError
from ..evaluation import Evaluation
from ..groups import Group, groups
from ..loggers import Logger
from ..loss import TokenCrossEntropy
from ..optim import OptimizerFactory
from ..peft import FullModel
from ..precision import Precision
from ..schedule import Schedule
from ..schema import public_path
from .assembly import JobSpec, Parts, Record, Trained
from .launcher import engine_for
from .session import Session
from ..store.rundir import check as check_run_dir
from .settings import (NOT_ARGUMENTS, SAMPLE_TOKENS, Checkpoint, Default, Settings, as_config, refuse_renamed,
                       settings_from)
from .settings import Settings as S  # train_model's defaults are the command line's, from one source
from .signals import Signals

log = logging.getLogger("looplib")

__all__ = ["train_model", "Trained", "Datasets"]


class Datasets(Corpus):
    """A corpus made of plain datasets: ``train_model``'s ``dataset`` and ``eval_dataset``."""

    def __init__(self, train: Dataset, eval: Dataset | None = None, collate=None):
        self.train, self.eval, self.collate = train, eval, collate


def train_model(model: nn.Module, dataset: Dataset | Corpus, *, max_steps: int = S.max_steps,
                batch_size: int | str = S.batch_size, accum_steps: int = S.accum_steps,
                global_batch_size: int | None = S.global_batch_size,
                objective: TokenCrossEntropy | None = None, precision: Precision | None = None,
                optim: OptimizerFactory | None = None, schedule: Schedule | None = None,
                peft: FullModel | None = None, compile: Compile | None = None,
                evaluation: Evaluation | None = None, checkpointing: Checkpointing | None = None,
                engine: Engine | None = None, logger: Logger | None = None, reward: Any = None,
                eval_dataset: Dataset | None = None, eval_every: int = S.eval_every,
                eval_samples: int | None = S.eval_samples, max_grad_norm: float | None = S.max_grad_norm,
                device: str = S.device, seed: int = S.seed, run_dir: str | Path | None = None,
                checkpoint_every: int | None = Checkpoint.every_steps, keep: int = Checkpoint.keep,
                checkpoint_async: bool = Checkpoint.asynchronous,
                resume: str | Path | None = S.resume, export: Literal["auto", "hf"] | None = "auto",
                metrics: str | Path | None = None, log_every: int = S.log_every, max_bad_steps: int = S.max_bad_steps,
                sample_tokens: int = SAMPLE_TOKENS, peak_tflops: float | None = S.peak_tflops,
                progress: str = S.progress, loader: dict[str, Any] | None = None, collate_fn=None,
                init_from: str | Path | None = None, **more: Any) -> Trained:
    """Train ``model`` on ``dataset`` (a dataset of dict samples, or a ``looplib.data.Corpus``
    such as ``TextCorpus``) with the given strategies (one per config group: ``looplib.groups``).
    ``collate_fn``: a corpus's ``collate`` for samples of different lengths; ``loader``: the
    DataLoader keys of the CLI's ``loader.*`` (num_workers, pin_memory, ...); ``init_from``: a finished
    run's directory (or one of its checkpoints) whose weights ``model`` starts from, only them
    (``model.init_from``, ``looplib.store.init_from``); ``checkpoint_every``:
    steps between checkpoints (0: only at the end, None: none at all, as ``checkpoint.enabled=false``);
    ``checkpoint_async``: written in the background while training goes on (``checkpoint.async=true``);
    ``sample_tokens``: left as it is, the command line's sample at the end where the data can
    encode a prompt (a ``Corpus``) and none otherwise. Every default is the command line's
    (``looplib.run.settings``: seed 1337, batch_size 32, ...). ``export``: ``auto`` writes what the CLI writes into the run directory (model.safetensors, hf/
    for a transformers model, the adapter under LoRA), ``hf`` insists on a transformers export,
    None writes no weights. ``**more``: the objects of groups added to ``looplib.groups.GROUPS``
    (a group of your own), by their argument name. Returns ``Trained`` (model, optimizer,
    scheduler, state, eval_loss, run_dir, last_row); raises ``looplib.RunEnded`` otherwise."""
    speak()
    refuse_renamed({**more, "batch_size": batch_size})  # eval_batches=: now eval_samples
    if engine is None or isinstance(engine, Engine):  # (anything else: refused below, naming the class to pass)
        engine = engine_for(engine, device)  # under torchrun without an engine: DDP, as on the command line
    given = dict(objective=objective, precision=precision, optim=optim, schedule=schedule, peft=peft, compile=compile,
                 evaluation=evaluation, checkpointing=checkpointing, engine=engine, logger=logger, reward=reward,
                 **more)
    settings = settings_from(dict(
        device=device, seed=seed, max_steps=max_steps, batch_size=batch_size, accum_steps=accum_steps,
        global_batch_size=global_batch_size, max_grad_norm=max_grad_norm, log_every=log_every, eval_every=eval_every,
        eval_samples=eval_samples, sample_tokens=int(sample_tokens), max_bad_steps=max_bad_steps,
        resume=None if resume is None else str(resume), peak_tflops=peak_tflops, progress=progress,
        loader=dict(loader or {}),
        checkpoint={"enabled": checkpoint_every is not None, "every_steps": checkpoint_every or 0, "keep": keep,
                    "async": checkpoint_async}))
    if isinstance(dataset, Corpus):
        if eval_dataset is not None or collate_fn is not None:
            raise ConfigError("eval_dataset", "a Corpus brings its own held-out split and collate",
                              "leave eval_dataset and collate_fn out, or pass plain datasets")
        data = dataset
    else:
        data = Datasets(dataset, eval_dataset, collate_fn)
    if sample_tokens and type(data).encode is Corpus.encode and isinstance(sample_tokens, Default):
        settings.sample_tokens = 0  # the default sample needs data that can encode a prompt: none here
    elif sample_tokens and type(data).encode is Corpus.encode:
        raise ConfigError("sample_tokens", "a sample at the end needs data that can encode a prompt (a Corpus)",
                          "pass a looplib.data.Corpus as the dataset, or leave sample_tokens out (or 0)")
    if resume is not None and run_dir is None:
        raise ConfigError("resume", f"resume={resume} needs the run directory to continue in",
                          "pass run_dir=PATH (the directory of the run to continue)")
    if run_dir is not None:
        check_run_dir(Path(run_dir), settings.resume, "run_dir")  # never mixed into another run's files
    rows = {row.argument: row for row in groups() if row.stage != "expensive"}
    check_strategies({rows[arg]: obj for arg, obj in given.items() if arg in rows})
    unknown = sorted(set(given) - set(rows))
    if unknown:
        raise ConfigError(unknown[0], f"train_model() got {unknown[0]}=, which is neither a setting nor a config group's "
                          "argument", "see help(looplib.train_model), or add the group's row to looplib.groups.GROUPS")
    if export not in ("auto", "hf", None):
        raise ConfigError("export", f"export={export!r} is not a kind of export",
                          "use export='auto' (what the command line writes), 'hf' or None (no weights)")
    if export == "hf" and not hasattr(model, "export"):
        raise ConfigError("export", f"export='hf' needs a transformers model (looplib.hf), not {type(model).__name__}",
                          "use export='auto' (model.safetensors), or wrap the model with looplib.hf.CausalLM")
    parts = Parts.of(model=model, data=data, **{rows[arg].part: obj for arg, obj in given.items()})
    signals = Signals()
    try:
        signals.__enter__()  # SIGTERM, SIGUSR1, Ctrl-C handled as on the command line
    except ValueError:  # not the main thread: signals stay with the caller
        signals = Signals()
    try:
        with Session(None if run_dir is None else Path(run_dir), signals,
                     metrics=None if metrics is None else Path(metrics), export=export is not None) as session:
            parts.fill(settings)  # the null objects, so that config.yaml names every part's class
            made = record(settings, parts, run_dir)
            if init_from is not None:  # a finished run's weights, only them (model.init_from), once checked
                made.config["model"]["init_from"] = str(init_from)
            return session.run(JobSpec(parts, settings, made, None if init_from is None else str(init_from)))
    except ConfigError:
        this().board.heard()  # under torchrun: every rank knows of the refusal before this one's caller exits
        raise
    finally:
        signals.__exit__()


def check_strategies(given: dict[Group, Any]) -> None:
    """Each strategy argument is the object its config group builds (or a subclass of its base):
    ``precision="bf16"`` is refused in one line naming the class to pass, not an AttributeError
    deep in the run."""
    for row, obj in given.items():
        if obj is None or isinstance(obj, row.base):
            continue
        base = f"{row.base.__module__}.{row.base.__name__}"
        if isinstance(obj, str):
            module, _, name = (option_class(row.name, obj) or "").rpartition(".")
            fix = (f"pass the object: {row.argument}={name}() (from {module} import {name})" if module else
                   f"pass a {row.base.__name__} object (the classes: docs/extending.md)")
            raise ConfigError(row.argument, f"{row.argument}={obj!r} is the command line's option name, not a "
                              "strategy object", fix)
        raise ConfigError(row.argument, f"{row.argument}={type(obj).__name__}(...) is not a {row.base.__name__}",
                          f"pass a {base} (or a subclass of it)")


def option_class(group: str, option: str) -> str | None:
    """The ``_target_`` of ``conf/<group>/<option>.yaml`` (read as text: no Hydra, no OmegaConf)."""
    import re
    from importlib import resources
    try:
        text = (resources.files("looplib.conf") / group / f"{option}.yaml").read_text()
    except (OSError, ModuleNotFoundError):
        return None
    found = re.search(r"^_target_:\s*([\w.]+)", text, re.M)
    return found.group(1) if found else None


def record(settings: Settings, parts: Parts, run_dir: str | Path | None) -> Record:
    """config.yaml of a Python run: the settings, and each part's class with its plain settings
    (a resumed run is refused if one of them changed, as on the command line)."""
    config = {k: v for k, v in as_config(settings).items() if k not in NOT_ARGUMENTS}  # what ran, no unused key
    for row in groups():
        if row.stage != "trackers":
            config[row.name] = config_of(parts.get(row.part), plain=row.stage != "expensive")
    where = f"run_dir={str(run_dir)!r}, " if run_dir is not None else ""
    return Record(config, name=Path(run_dir).name if run_dir else "looplib",
                  resume_hint=f"train_model(..., {where}resume='auto')")


def config_of(obj: Any, plain: bool = True) -> dict:
    """``{"_target_": "package.Class", key: value, ...}``: the object's class and, when ``plain``,
    its public attributes that are plain values (numbers, strings, booleans, tuples of them).
    Nothing that differs per rank (an engine's rank, its device) is part of it."""
    if obj is None:
        return {"_target_": None}
    out: dict[str, Any] = {"_target_": public_path(type(obj))}
    for key, value in (vars(obj).items() if plain and hasattr(obj, "__dict__") else ()):
        if key.startswith("_") or key in getattr(obj, "per_process", ()):
            continue
        if isinstance(value, (bool, int, float, str, type(None))):
            out[key] = value
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            out[key] = list(value)
    return out


def speak() -> None:
    """Progress lines reach the caller as they do from the CLI: when nothing is configured
    (no handler on ``looplib`` nor on the root logger), add one that prints INFO to stderr."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s][looplib] %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the caller's later basicConfig() would print every line twice
