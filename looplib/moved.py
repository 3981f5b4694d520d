"""Old import paths, kept for one release: each works, with a ``FutureWarning`` naming the new path.

The house was rearranged into three wings (the loop and one module per config group at the top;
``looplib.run``, a run's life without Hydra; ``looplib.cli``, the command line): a config whose
``_target_`` names an old path (``looplib.rundir_guard.RunDirGuard``, ``looplib.adapters.LoRA``),
or code importing one (``from looplib.checkpoints import SaveError``), keeps working until the
next release, and says where the name lives now. Nothing here is imported under a new name
silently: every use of an old path warns.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old module -> the modules its names live in now (searched in order)
MODULES: dict[str, tuple[str, ...]] = {
    "looplib.assemble": ("looplib.run.assembly", "looplib.run.training", "looplib.run.lifecycle"),
    "looplib.autobatch": ("looplib.run.autobatch",),
    "looplib.settings": ("looplib.run.settings",),
    "looplib.rundir": ("looplib.run.rundir", "looplib.cli.guard"),
    "looplib.resume": ("looplib.run.resume",),
    "looplib.checkpoints": ("looplib.run.saving", "looplib.errors", "looplib.run.resume"),
    "looplib.checkpoint_files": ("looplib.run.checkpoint_dir", "looplib.atomic"),
    "looplib.signals": ("looplib.run.signals", "looplib.errors"),
    "looplib.plots": ("looplib.run.plots",),
    "looplib.api": ("looplib.run.api", "looplib.run.lifecycle"),
    "looplib.build": ("looplib.cli.instantiate",),
    "looplib.resolvers": ("looplib.cli.resolvers",),
    "looplib.rundir_guard": ("looplib.cli.guard",),
    "looplib.sweep": ("looplib.cli.sweep",),
    "looplib.report_study": ("looplib.report.study",),
    "looplib.state": ("looplib.run.checkpoint_dir", "looplib.run.saving", "looplib.run.resume", "looplib.errors",
                      "looplib.train_state"),
    "looplib.adapters": ("looplib.peft",),
    "looplib.objectives": ("looplib.loss",),
    "looplib.data.corpora": ("looplib.data", "looplib.data.files", "looplib.data.records"),
    "looplib.plan.cli": ("looplib.cli.plan",),
}

# names that left a module which is still there: (module, name) -> new module
NAMES: dict[tuple[str, str], str] = {
    ("looplib.cli", "normalise"): "looplib.cli.args",
    ("looplib.cli", "follow_advice"): "looplib.cli.args",
    ("looplib.cli", "explain"): "looplib.cli.args",
    ("looplib.train", "main"): "looplib.cli.main",
    ("looplib.train", "build_job"): "looplib.cli.main",
    ("looplib.train", "record"): "looplib.cli.main",
    ("looplib.generate", "main"): "looplib.cli.generate",
    ("looplib.plan", "build_plan"): "looplib.cli.plan",
    ("looplib.plan", "main"): "looplib.cli.plan",
    ("looplib.loggers", "build"): "looplib.cli.instantiate",
    ("looplib.optim", "Schedule"): "looplib.schedule",
    ("looplib.optim", "Constant"): "looplib.schedule",
    ("looplib.optim", "WarmupCosine"): "looplib.schedule",
    **{("looplib.cli.tune", name): "looplib.tune.driver" for name in (
        "memory_limit", "cache_file", "Progress", "tuned", "outcome", "dry_run", "finish")},
    ("looplib.tune.measure", "World"): "looplib.tune.world",
}
RENAMED = {("looplib.loggers", "build"): "build_loggers", ("looplib.assemble", "run"): "train"}


def warn(old: str, found, stacklevel: int) -> None:
    """Say where ``old`` (a dotted name) lives now: where the object ``found`` was defined."""
    new = f"{found.__module__}.{found.__qualname__}" if hasattr(found, "__qualname__") else old
    warnings.warn(f"{old} has moved to {new}; the old path goes in the next release (docs/extending.md)",
                  FutureWarning, stacklevel=stacklevel)


def attribute(module: str, name: str):
    """``module.name`` for a module's ``__getattr__``: a name that moved away, found where it is now."""
    if (module, name) not in NAMES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    found = getattr(importlib.import_module(NAMES[module, name]), RENAMED.get((module, name), name))
    warn(f"{module}.{name}", found, stacklevel=4)  # the caller of the module's __getattr__
    return found


class OldModule(types.ModuleType):
    """An old module path: each name looked up where it lives now, with a warning."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        wanted = RENAMED.get((self.__name__, name), name)
        for new in MODULES[self.__name__]:
            module = importlib.import_module(new)
            if hasattr(module, wanted):
                found = getattr(module, wanted)
                warn(f"{self.__name__}.{name}", found, stacklevel=3)
                return found
        raise AttributeError(f"module {self.__name__!r} (now {', '.join(MODULES[self.__name__])}) has no "
                             f"attribute {name!r}")


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of ``MODULES`` (installed on ``sys.meta_path`` by ``import looplib``)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MODULES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):  # each name used through it warns (OldModule.__getattr__)
        return OldModule(spec.name, f"the old path of {', '.join(MODULES[spec.name])}")

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
