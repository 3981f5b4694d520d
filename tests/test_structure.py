"""The house's structure: one helper for optional imports, and no import arrow running back up."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from looplib.errors import ConfigError, need

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "looplib"


def modules() -> dict[str, Path]:
    """Every module of looplib by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def test_need_returns_the_module_or_refuses_in_one_line_naming_the_extra():
    import json
    assert need("json", "x", "some.setting") is json
    with pytest.raises(ConfigError) as err:
        need("looplib_no_such_module.sub", "bnb", "optim", "+optim=thing", "choose +optim=adamw")
    assert err.value.key == "optim"
    assert str(err.value) == ("optim: +optim=thing needs the looplib_no_such_module package, which does not import "
                              "(No module named 'looplib_no_such_module'); pip install 'looplib[bnb]', or choose "
                              "+optim=adamw")


def test_every_extra_named_for_an_optional_import_exists():
    """``need(module, extra, ...)`` anywhere in looplib names an extra that pyproject.toml defines."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("need", "need_tracker") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant):
                named.append((name, node.args[1].value))
    assert len(named) >= 7  # the optional libraries: bitsandbytes, torchao, peft, deepspeed, ...
    assert [(name, extra) for name, extra in named if extra not in extras] == []


# Floors, lowest first: a module may import from its own floor or any below, never from one above.
# A module's floor is that of the longest name listed that is it or a package holding it.
FLOORS = [
    # foundations: no looplib imports but these
    ["looplib.errors", "looplib.signals", "looplib.schema", "looplib.train_state", "looplib.accumulation"],
    # strategies, data, models, and the checkpoint directory format
    ["looplib.precision", "looplib.optim", "looplib.schedule", "looplib.checkpointing", "looplib.compile",
     "looplib.objectives", "looplib.loss", "looplib.evaluation", "looplib.data", "looplib.models", "looplib.hf",
     "looplib.checkpoint_files"],
    # engines
    ["looplib.engines"],
    # the run: the loop, saving and resuming, telemetry and trackers, adapters saved through the
    # engine, generation, and the config layer (building strategies from the config, resolvers, plan)
    ["looplib.loop", "looplib.checkpoints", "looplib.resume", "looplib.state", "looplib.telemetry",
     "looplib.loggers", "looplib.plots", "looplib.adapters", "looplib.peft", "looplib.generate", "looplib.build",
     "looplib.settings", "looplib.resolvers", "looplib.plan"],
    # one assembly of a run, and what builds on it
    ["looplib.assemble", "looplib.autobatch"],
    # the ways in: command lines, the Python API, tools
    ["looplib", "looplib.train", "looplib.api", "looplib.tune", "looplib.cli", "looplib.rundir", "looplib.rundir_guard", "looplib.sweep", "looplib.report", "looplib.report_study",
     "looplib.make_tiny_model"],
]


def floor_of(name: str) -> int | None:
    best = None
    for i, floor in enumerate(FLOORS):
        for prefix in floor:
            if (name == prefix or name.startswith(prefix + ".") and prefix != "looplib") and \
                    (best is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    return best[0] if best else None


def type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
    return lines


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The looplib modules ``name`` imports, at the top or inside functions."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip, out = type_checking_only(tree), set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_module_imports_one_from_a_floor_above():
    known = modules()
    unplaced = sorted(name for name in known if floor_of(name) is None)
    assert unplaced == [], "give each module a floor in FLOORS"
    upward = [f"{name} (floor {floor_of(name)}) imports {target} (floor {floor_of(target)})"
              for name, path in known.items() for target in sorted(imports_of(name, path, known))
              if floor_of(target) > floor_of(name)]
    assert upward == []


def test_the_import_walk_sees_relative_imports_inside_functions(tmp_path):
    """The walk itself: a relative import inside a function is an arrow; TYPE_CHECKING ones are not."""
    path = tmp_path / "mod.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import fit\n"
                    "def f():\n    from ..errors import need\n    from . import optim\n")
    known = {"looplib.engines.mod": path, "looplib.errors": path, "looplib.engines": path,
             "looplib.engines.optim": path, "looplib.loop": path}
    assert imports_of("looplib.engines.mod", path, known) == {"looplib.errors", "looplib.engines.optim"}
