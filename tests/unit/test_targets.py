"""One class, one name: the ``_target_`` a run records is the same whether the command line or
``train_model`` built the object, and a resume never mistakes two spellings of one class for a
change (a run started on the command line, resumed through ``train_model``, was refused before:
``looplib.engines.DDP`` against ``looplib.engines.ddp.DDP``)."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from looplib.errors import ConfigError
from looplib.run.api import config_of
from looplib.schema import public_path, same_target
from looplib.store.resume import check_resume_config, config_changes

CONF = Path(__file__).resolve().parents[2] / "conf"


def targets():
    for f in sorted(CONF.rglob("*.yaml")):
        for found in re.finditer(r"^_target_:\s*([\w.]+)", f.read_text(), re.M):
            yield f.relative_to(CONF).as_posix(), found.group(1)


@pytest.mark.parametrize("where,target", list(targets()))
def test_every_option_names_its_class_as_train_model_records_it(where, target):
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if cls.__qualname__ != name:  # an alias (engine=local is Engine, precision=fp32 Precision): one object
        assert same_target(target, public_path(cls))
        return
    assert public_path(cls) == target, f"conf/{where} names {target}; train_model records {public_path(cls)}"


def test_train_model_records_the_package_export_not_the_defining_module():
    from looplib.engines.ddp import DDP
    assert DDP.__module__ == "looplib.engines.ddp"
    assert config_of(DDP.__new__(DDP), plain=False) == {"_target_": "looplib.engines.DDP"}


def test_two_spellings_of_one_class_are_no_change_on_resume_but_another_class_is():
    saved = {"engine": {"_target_": "looplib.engines.ddp.DDP"}, "lr": 0.1}
    assert config_changes(saved, {"engine": {"_target_": "looplib.engines.DDP"}, "lr": 0.1}) == []
    assert check_resume_config(saved, {"engine": {"_target_": "looplib.engines.DDP"}, "lr": 0.1}) == []
    other = {"engine": {"_target_": "looplib.engines.Engine"}, "lr": 0.1}
    assert config_changes(saved, other) == [("engine._target_", "looplib.engines.ddp.DDP", "looplib.engines.Engine")]
    with pytest.raises(ConfigError, match="engine._target_"):
        check_resume_config(saved, other)
    assert not same_target("looplib.engines.DDP", "no_such_package.DDP")
