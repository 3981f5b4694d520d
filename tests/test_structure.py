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
