"""The config groups, listed once: every other list of them is derived from ``GROUPS``.

One row per group says what a newcomer (and the code) needs to know about it:

    name      the folder ``conf/<name>/`` and the config key; the module of its built-in classes
              is named after it (``looplib/<name>.py`` or a package)
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

From the rows come: ``looplib.run.assembly.Parts`` (its attributes), ``train_model``'s check of
its strategy arguments, the config a run saves, the command line's groups, their defaults and
what it instantiates, tune's dimensions, and the table in docs/extending.md (a test compares it).
Adding a group is one module, one ``conf/<group>/`` folder and one row here (docs/extending.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from torch import nn

from .checkpointing import Checkpointing
from .compile import Compile
from .data import Corpus
from .engines import Engine
from .evaluation import Evaluation
from .loggers import Logger
from .loss import TokenCrossEntropy
from .optim import AdamW, OptimizerFactory
from .peft import FullModel
from .precision import Precision
from .schedule import Schedule


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

    @property
    def spelled(self) -> str:
        """How the command line chooses it: ``+precision=`` or ``model=``."""
        return f"{'+' if self.appended else ''}{self.name}="


def made(cls: type) -> Callable[[Any], Any]:
    """A null object of ``cls`` for any job (its settings unused)."""
    return lambda settings: cls()


GROUPS: list[Group] = [
    Group("model", nn.Module, None, "tiny", False, "model", "model", stage="expensive"),
    Group("data", Corpus, None, "pysource", False, "dataset", "data", stage="expensive"),
    Group("checkpointing", Checkpointing, made(Checkpointing), "none", True, "checkpointing", "checkpointing", "exact"),
    Group("compile", Compile, made(Compile), "none", True, "compile", "compile", "exact"),
    Group("loss", object, made(TokenCrossEntropy), "lm", False, "objective", "objective", "exact"),
    Group("engine", Engine, lambda settings: Engine(settings.device), "local", True, "engine", "engine", "exact"),
    Group("precision", Precision, made(Precision), "fp32", True, "precision", "precision", "numerics"),
    Group("optim", OptimizerFactory, made(AdamW), "adamw", True, "optim", "optim", "numerics"),
    Group("schedule", Schedule, made(Schedule), "constant", True, "schedule", "schedule"),
    Group("peft", FullModel, made(FullModel), "none", True, "peft", "peft"),
    Group("evaluation", Evaluation, made(Evaluation), "as_trained", True, "evaluation", "evaluation"),
    Group("logger", Logger, made(Logger), None, True, "logger", "logger", stage="trackers"),
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
    return "any object" if row.base is object else f"{row.base.__module__}.{row.base.__qualname__}"


def null_name(row: Group, settings: Any = None) -> str:
    if row.null is None:
        return "required"
    if row.name == "engine":
        return "Engine(device)"
    return type(row.null(settings)).__qualname__ + "()"


def markdown_table(options: Callable[[str], list[str]]) -> list[str]:
    """docs/extending.md's table of groups (``options(name)``: the group's option names)."""
    rows = ["| group | options | base class | absent | `train_model` | tune |", "|---|---|---|---|---|---|"]
    for g in GROUPS:
        listed = ", ".join(f"`{o}`" for o in options(g.name)) or "-"
        tune = {"exact": "searched", "numerics": "with `tune.numerics=allow`", "": "-"}[g.tuned]
        rows.append(f"| `{g.spelled}` | {listed} | `{base_name(g)}` | {null_name(g)} | `{g.argument}=` | {tune} |")
    return rows
