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


# How train_model spells a setting that is not its keyword of the same name (looplib/run/api.py). A new
# setting of Settings is either train_model's keyword of its own name with the same default, or named here.
ARGUMENT = {"checkpoint.every_steps": "checkpoint_every", "checkpoint.keep": "keep",
            "checkpoint.async": "checkpoint_async"}  # checkpoint.enabled=false: checkpoint_every=None
SECTION_ARGUMENT = {"loader": "loader"}  # one dict of the section's keys; its default None: Settings' defaults
CLI_ONLY = {"sweep"}  # what each job returns to a Hydra sweeper: train_model runs under none


def flat(values: dict, prefix: str = "") -> dict:
    """``{"checkpoint": {"keep": 2}}`` as ``{"checkpoint.keep": 2}``: the keys as typed on the command line."""
    out = {}
    for key, value in values.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_settings_is_the_one_source_of_the_top_level_settings():
    """``Settings`` (looplib/run/settings.py) is the source of the top-level settings; the others are
    held to it here, and only here: conf/config.yaml's top-level keys (less the defaults list and
    hydra) with the same values, train_model's keyword arguments with the same defaults (seed 1337
    both ways; train_model's was 0), docs/command-line.md's settings table with every key and its
    default, and docs/python-api.md naming every such argument."""
    import inspect
    import re

    from omegaconf import OmegaConf

    from looplib import train_model
    from looplib.run.settings import NOT_ARGUMENTS, Settings, as_config
    defaults = as_config(Settings())
    keys = flat(defaults)

    conf = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    assert set(conf) - {"defaults", "hydra"} == set(defaults), "conf/config.yaml's settings are Settings' fields"
    in_conf = flat({k: v for k, v in conf.items() if k in defaults})  # in conf/config.yaml's order
    assert in_conf == keys, "conf/config.yaml's values are Settings' defaults"

    expected = {}  # train_model's keyword: its default
    for key, value in keys.items():
        section = key.split(".")[0]
        if section in NOT_ARGUMENTS or section in CLI_ONLY or key == "checkpoint.enabled":
            continue
        if section in SECTION_ARGUMENT:
            expected[SECTION_ARGUMENT[section]] = None
        else:
            expected[ARGUMENT.get(key, key)] = value
    params = inspect.signature(train_model).parameters
    assert set(expected) - set(params) == set(), "give train_model the keyword (Settings' default), or name it in ARGUMENT"
    assert {name: params[name].default for name in expected} == expected
    assert (params["checkpoint_every"].default is not None) is keys["checkpoint.enabled"]
    api = (REPO / "docs" / "python-api.md").read_text()
    assert [name for name in expected if not re.search(rf"`{name}[=`]", api)] == [], "docs/python-api.md's table"

    text = (REPO / "docs" / "command-line.md").read_text()
    table = text[text.index("## Settings and groups"):text.index("The job's groups are in the defaults list")]
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", table, re.M)
    assert [key for key, _ in rows] == list(in_conf), "docs/command-line.md's settings table: every key, in config.yaml's order"
    assert {key: OmegaConf.create(f"v: {cell}").v for key, cell in rows} == keys, "the table's defaults"
