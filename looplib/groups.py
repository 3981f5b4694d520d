"""The config groups, listed once: every other list of them is derived from ``GROUPS``.

One row per group says what a newcomer (and the code) needs to know about it:

    name      the folder ``conf/<name>/`` and the config key; the module of its built-in classes
              is named after it (``looplib/<name>.py`` or a package), but for ``checkpointing``,
              whose module is ``looplib/activations.py`` (activation memory: saved checkpoints of
              the run are ``looplib.store``; the command line keeps ``+checkpointing=``)
    base      what its options build: a subclass of this (``object``: any object with the verbs)
    null      the object an absent group means (the plain-PyTorch default), made from the
              job's settings; None where the part is required (the model, the data)
    option    that default as a file, ``conf/<name>/<option>.yaml`` (None: no file)
    appended  True: a strategy group, kept out of conf/config.yaml's defaults list so that
              ``+name=option`` works as typed; False: a job group, switched with ``name=option``
    argument  ``train_model``'s keyword argument for it
    part      the attribute of ``Parts`` and ``Job`` that holds it
    tuned     ``exact``: ``looplib.tune`` searches it (same math); ``numerics``: only with
              ``tune.numerics=allow`` (it changes the numbers); "": not searched
    stage     ``strategy``: cheap to build, built first and checked before anything else;
              ``expensive``: built after every check passed (the data, the model);
              ``trackers``: several named options at once (``+logger=[a,b]``), not in the saved config
    calls     what looplib calls on its objects (docs/extending.md's table)

From the rows come: ``looplib.run.assembly.Parts`` (its attributes), ``train_model``'s check of
its strategy arguments, the config a run saves, the command line's groups, their defaults and
what it instantiates, tune's dimensions, and the table in docs/extending.md (a test compares it).
Adding a group is one module, one ``conf/<group>/`` folder and one row here (docs/extending.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, Literal

from torch import nn

from .activations import Checkpointing
from .compile import Compile
from .data import Corpus
from .engines import Engine
from .evaluation import Evaluation
from .loggers import Logger
from .loss import TokenCrossEntropy
from .optim import AdamW, OptimizerFactory
from .peft import FullModel
from .precision import Precision
from .reward import NoReward
from .schedule import Schedule
from .schema import public_path


@dataclass(frozen=True)
class Group:
    name: str
    base: type
    null: Callable[[Any], Any] | None
    option: str | None
    appended: bool
    argument: str
    part: str
    tuned: Literal["", "exact", "numerics"] = ""
    stage: Literal["strategy", "expensive", "trackers"] = "strategy"
    calls: str = ""  # what looplib calls on its objects: the contract a class of one's own keeps (docs)

    @property
    def spelled(self) -> str:
        """How the command line chooses it: ``+precision=`` or ``model=``."""
        return f"{'+' if self.appended else ''}{self.name}="


def made(cls: type) -> Callable[[Any], Any]:
    """A null object of ``cls`` for any job (its settings unused)."""
    return lambda settings: cls()


GROUPS: list[Group] = [
    Group("model", nn.Module, None, "tiny", False, "model", "model", stage="expensive", calls=(
        '`model(batch["input_ids"])` -> logits (by the LM losses); optional `generate(ids, n, generator=)` for the '
        "end-of-run sample; a `seq_len` key that data configs read as `${model.seq_len}`")),
    Group("data", Corpus, None, "pysource", False, "dataset", "data", stage="expensive", calls=(
        "`.train`, `.eval`: map-style datasets of dict samples; `encode(text)`, `decode(ids)`; a `vocab_size` key "
        "that model configs read as `${data.vocab_size}`; a class that takes the keyword `expected` is handed, "
        "under a resume, the checkpoint's identity to compare itself with as it is built (`looplib.data.identity`) "
        "([data.md](data.md))")),
    Group("checkpointing", Checkpointing, made(Checkpointing), "none", True, "checkpointing", "checkpointing", "exact",
          calls="`check(engine, compile)` at assembly; `apply(model) -> model` (activation memory: recompute, keep "
                "or offload what chosen blocks save for backward; not saved checkpoints, see [memory.md](memory.md)); "
                "`kind` tells the planner which"),
    Group("compile", Compile, made(Compile), "none", True, "compile", "compile", "exact",
          calls="`wrap(model) -> model`, after the model is on its device; `compile_step(optimizer)` before "
                "training; `clip_and_step(optimizer, precision, params, max_norm) -> (grad_norm, skipped)` ends "
                "each window of the loop (plain PyTorch: `looplib.loop.EagerStep`'s)"),
    Group("loss", object, made(TokenCrossEntropy), "lm", False, "objective", "objective", "exact", calls=(
        "`__call__(model, batch)` -> the loss **summed** over the batch's items; `count(batch)` -> how many items, "
        "on the host batch")),
    Group("engine", Engine, lambda settings: Engine(settings.device), "local", True, "engine", "engine", "exact", calls=(
        "`precision_for(precision)` and `check(...)` at assembly, `setup(model)`, `prepare(model, optimizer, "
        "settings)`; in the loop `to_device(batch)`, `accumulating(model, last)`, `global_items(items)`; "
        "`unwrap(model)`, `full_weights` (the store writes the exports), `close()`; it names its collectives (`engine.ranks`: "
        "`looplib.process.collectives`) and its checkpoint format (`checkpoint_format`: `looplib.store.formats`) "
        "([engines.md](engines.md))")),
    Group("precision", Precision, made(Precision), "fp32", True, "precision", "precision", "numerics", calls=(
        "`setup(device)` once; per micro-batch `autocast()` (a context for forward and loss) and `backward(loss)`; "
        "per step `unscale(optimizer)` then `step(optimizer, grad_norm)` (`compile.optimizer=true`'s compiled "
        "clip-and-step calls `skips_on(optimizer)` and `stepped(optimizer)` instead of `step`); "
        "`state_dict()`/`load_state_dict()`; "
        "`close()` at the end")),
    Group("optim", OptimizerFactory, made(AdamW), "adamw", True, "optim", "optim", "numerics", calls=(
        "`build(model) -> torch.optim.Optimizer`; override `create(groups)` and get looplib's parameter groups "
        "(weights decay; biases, norms, embeddings and frozen parameters do not)")),
    Group("schedule", Schedule, made(Schedule), "constant", True, "schedule", "schedule",
          calls="`build(optimizer, total_steps)`; override `factor(step, total_steps)` (a multiplier of lr)"),
    Group("peft", FullModel, made(FullModel), "none", True, "peft", "peft", "numerics",
          calls="`check(engine, precision)` at assembly; the model built inside `loading()`; `wrap(model) -> model` "
                "before the model moves to its device; `exports() -> Exports` at the end (what the run exports: "
                "`looplib.store.export` writes it)"),
    Group("evaluation", Evaluation, made(Evaluation), "as_trained", True, "evaluation", "evaluation",
          calls="`__call__(model, batches, objective, precision, engine) -> float` (mean loss per item)"),
    Group("reward", object, made(NoReward), "none", True, "reward", "reward", calls=(
        "`reward(prompts, completions, records) -> list[float]`, one finite number per completion, for `loss=grpo` "
        "(a function: `reward._target_=my_pkg.fn`; several: `looplib.reward.Weighted`) ([post-training.md]"
        "(post-training.md#reinforcement-learning-with-verifiable-rewards-grpo))")),
    Group("logger", Logger, made(Logger), None, True, "logger", "logger", stage="trackers", calls=(
        "`start(run)` once (`run.dir`, `run.config`, `run.name`, `run.group`: the sweep, `run.resumed_from`); "
        "`log(row)` per metrics row; `finish(status, artefacts)` once (`finished`/`preempted`/`failed`, "
        "`{name: path}`); rank 0 only; several at once: `'+logger=[tensorboard,mlflow]'` "
        "([run-directory.md](run-directory.md#trackers-tensorboard-mlflow-wb))")),
]


def groups() -> list[Group]:
    """The rows as they are now (a group of one's own may have been appended to ``GROUPS``)."""
    return list(GROUPS)


def group(name: str) -> Group:
    for row in GROUPS:
        if row.name == name:
            return row
    raise KeyError(name)


def strategies() -> list[Group]:
    """The groups cheap to build (no data, no model, no tracker): built and checked first."""
    return [g for g in GROUPS if g.stage == "strategy"]


def appended_defaults() -> dict[str, str]:
    """``{group: option}`` for every strategy group with a default file: what an absent one means."""
    return {g.name: g.option for g in GROUPS if g.appended and g.option is not None}


def tuned(kind: str | None = None) -> list[str]:
    """The groups tune searches (``kind``: only ``exact`` or only ``numerics``)."""
    return [g.name for g in GROUPS if g.tuned and (kind is None or g.tuned == kind)]


def base_name(row: Group) -> str:
    """The shortest public path of the row's base class (``looplib.data.Corpus``, ``torch.nn.Module``)."""
    if row.base is object:
        return "any object"
    return public_path(row.base, shortest=True)


def options(name: str) -> list[str]:
    """The options of a group as shipped (the files of ``conf/<name>/``), its default first."""
    folder = resources.files("looplib.conf") / name
    found = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
    default = group(name).option if name in {g.name for g in GROUPS} else None
    return sorted(found, key=lambda o: o != default)


def null_name(row: Group, settings: Any = None) -> str:
    if row.null is None:
        return "required"
    if row.name == "engine":
        return "Engine(device)"
    return type(row.null(settings)).__qualname__ + "()"


def markdown_table(rows: list[Group] | None = None, listed: Callable[[str], list[str]] = options) -> list[str]:
    """docs/extending.md's table of groups, one line per row (``listed(name)``: a group's option names)."""
    out = ["| group | options | base class | absent | `train_model` | tune | what looplib calls |",
           "|---|---|---|---|---|---|---|"]
    for g in GROUPS if rows is None else rows:
        names = ", ".join(f"`{o}`" for o in listed(g.name)) or "-"
        tune = {"exact": "searched", "numerics": "with `tune.numerics=allow`", "": "-"}[g.tuned]
        out.append(f"| `{g.spelled}` | {names} | `{base_name(g)}` | {null_name(g)} | `{g.argument}=` | {tune} | "
                   f"{g.calls} |")
    return out
