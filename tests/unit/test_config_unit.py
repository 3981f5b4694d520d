"""The config files read as text and the defaults' one source, without Hydra (the tests that compose: tests/cli/test_config.py)."""
from looplib import groups

from conftest import REPO
from test_config import CONF, GROUPS  # noqa: F401 - helpers and fixtures the tests share


def test_every_yaml_opens_with_the_command_that_uses_it():
    for path in CONF.rglob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# python -m looplib.train"), path


def test_the_table_of_groups_is_conf_and_its_defaults_list():
    """looplib.groups lists every folder of conf/ (hydra/ aside), the job groups are conf/config.yaml's
    defaults list with their default option, and every default option is a file of its group."""
    import yaml
    assert sorted(g.name for g in groups.GROUPS) == [g for g in GROUPS if g != "hydra"]
    listed = {k: v for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"] if isinstance(entry, dict)
              for k, v in entry.items() if not k.startswith("override")}
    assert listed == {g.name: g.option for g in groups.GROUPS if not g.appended}
    for g in groups.GROUPS:
        assert g.option is None or (CONF / g.name / f"{g.option}.yaml").is_file(), g
        assert (g.option is None) == (g.stage == "trackers"), g  # the trackers' group alone has no default file


def test_conf_config_yaml_and_train_model_take_their_defaults_from_one_source():
    """looplib.run.settings is the one source of the job's defaults: conf/config.yaml holds the same
    value for every setting (seed 1337 both ways; train_model's was 0), and so does every
    keyword argument of train_model that is a command-line setting."""
    import inspect
    from dataclasses import fields

    from omegaconf import OmegaConf

    from looplib import train_model
    from looplib.run.settings import NOT_ARGUMENTS, Settings, as_config
    conf = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    defaults = as_config(Settings())
    assert {k: conf[k] for k in defaults} == defaults
    assert set(conf) - set(defaults) == {"defaults", "hydra"}  # every setting is a Settings field
    signature = inspect.signature(train_model).parameters
    shared = {f.name for f in fields(Settings)} - set(NOT_ARGUMENTS) - {"checkpoint", "loader", "sweep"}
    assert {k: signature[k].default for k in shared} == {k: defaults[k] for k in shared}
    assert shared | {"checkpoint_every", "keep", "loader"} <= set(signature)
    assert (signature["checkpoint_every"].default, signature["keep"].default, signature["checkpoint_async"].default) \
        == (defaults["checkpoint"]["every_steps"], defaults["checkpoint"]["keep"], defaults["checkpoint"]["async"])
    assert signature["loader"].default is None  # None: loader's defaults (Settings.loader)
