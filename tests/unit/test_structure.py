"""The house's structure: one helper for optional imports, and no import arrow running back up."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from looplib.errors import ConfigError, need

ROOT = Path(__file__).resolve().parents[2]
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


# Floors, from the package layout: the top wing (the loop, one module per config group, and the
# packages data, models, hf, engines, loggers, plan) is floor 0; looplib.run (a run's life
# without Hydra) floor 1; looplib.cli (the command line), looplib.report and looplib.tune (tools
# built on runs: tune's driver holds a run's signals and directory rules) floor 2; the doors
# (the package itself, ``__main__`` modules and modules run with ``python -m``) floor 3. A module
# may import from its own floor or any below, never from one above; and no module, on any floor,
# is part of an import circle.
WINGS = {"looplib.run": 1, "looplib.store": 1, "looplib.cli": 2, "looplib.report": 2, "looplib.tune": 2}
DOOR = 3


def is_door(name: str, path: Path) -> bool:
    """The package, a ``__main__`` module, or a module with an ``if __name__ == "__main__":`` block."""
    if name == "looplib" or name.endswith(".__main__"):
        return True
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(path.read_text()).body)


def floor_of(name: str, path: Path) -> int:
    if is_door(name, path):
        return DOOR
    return next((floor for wing, floor in WINGS.items() if name == wing or name.startswith(wing + ".")), 0)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (a strongly connected set of two or more modules, or one importing itself)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


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


def graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    known = modules()
    return known, {name: imports_of(name, path, known) for name, path in known.items()}


def test_no_module_imports_one_from_a_floor_above():
    known, arrows = graph()
    upward = [f"{name} (floor {floor_of(name, known[name])}) imports {target} (floor {floor_of(target, known[target])})"
              for name, targets in arrows.items() for target in sorted(targets)
              if floor_of(target, known[target]) > floor_of(name, known[name])]
    assert upward == []


def test_no_import_circle_anywhere():
    _, arrows = graph()
    assert [" -> ".join(c) for c in circles(arrows)] == []


def test_the_circle_finder_names_the_modules_of_a_circle():
    found = circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}})
    assert found == [["a", "b", "c"], ["e"]]


def test_only_the_command_line_imports_hydra_or_omegaconf():
    """Below looplib.cli (the top wing, looplib.run, looplib.report) nothing imports Hydra or OmegaConf,
    at the top of a module or inside a function."""
    offenders = []
    for name, path in modules().items():
        if name == "looplib.cli" or name.startswith("looplib.cli."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{name} imports {n}" for n in names if n.split(".")[0] in ("hydra", "omegaconf")]
    assert offenders == []


def test_the_import_walk_sees_relative_imports_inside_functions(tmp_path):
    """The walk itself: a relative import inside a function is an arrow; TYPE_CHECKING ones are not."""
    path = tmp_path / "mod.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import fit\n"
                    "def f():\n    from ..errors import need\n    from . import optim\n")
    known = {"looplib.engines.mod": path, "looplib.errors": path, "looplib.engines": path,
             "looplib.engines.optim": path, "looplib.loop": path}
    assert imports_of("looplib.engines.mod", path, known) == {"looplib.errors", "looplib.engines.optim"}


STRATEGY_MODULES = ["activations", "compile", "evaluation", "grpo", "loss", "muon", "optim", "peft", "precision",
                    "preference", "reward", "schedule"]


def test_no_strategy_asks_isinstance_of_an_engine_or_a_bundled_model():
    """A strategy reads what a model or an engine declares (``lora_targets``, ``weights_from``, an
    engine's flags); an ``isinstance`` against ``looplib.engines`` or ``looplib.models`` would tie it
    to one class of each (a subclass of one's own, or a wrapper, would be treated as a stranger)."""
    for name in STRATEGY_MODULES:
        path = PACKAGE / f"{name}.py"
        tree = ast.parse(path.read_text())
        tied = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.level and (node.module or "").split(".")[0] in ("engines", "models")
                for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                used = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not used & tied, f"looplib/{name}.py:{node.lineno} asks isinstance of {sorted(used & tied)}"


def test_the_bundled_gpt_declares_the_lora_targets_peft_names():
    from looplib import GPT_LINEARS
    from looplib.models.gpt import GPT
    assert tuple(GPT.lora_targets) == tuple(GPT_LINEARS)


def test_the_unit_tier_starts_no_process_and_imports_no_hydra():
    """tests/unit is the developer's quick check (issue 42): in-process, no subprocess, no Hydra, no
    command line. A test that needs one of them lives in tests/cli or tests/dist."""
    unit = Path(__file__).resolve().parent
    pattern = re.compile(r"^\s*(import (hydra|subprocess)\b|from (hydra|subprocess|looplib\.cli)\b|"
                         r"from conftest import .*\brun_cli\b)", re.M)
    found = {f.name: m.group(0).strip() for f in sorted(unit.glob("*.py")) for m in [pattern.search(f.read_text())] if m}
    assert found == {}, f"move these tests to tests/cli: {found}"
