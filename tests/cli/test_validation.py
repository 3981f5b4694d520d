"""Every key a user can set is checked once, at build time (looplib/schema.py via build.check_config):
unknown keys with the closest name, types, ranges, non-finite numbers; the option that chose a
class is named; one set of optimizer defaults for the YAML files, the classes and train_model."""
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.utils import _locate
from omegaconf import OmegaConf, open_dict

from looplib import optim as lo
from looplib.cli.instantiate import check_config, instantiate
from looplib.run.settings import Settings
from looplib.errors import ConfigError
from looplib.cli.plan import main as plan_main
from looplib.schema import parameters

from conftest import REPO, run_cli

CONF = REPO / "conf"
GROUP_FILES = sorted(p for p in CONF.glob("*/*.yaml") if p.parent.name != "hydra")


def compose_with(*overrides, as_cli=False):
    """The config ``python -m looplib.train OVERRIDES`` sees; ``as_cli``: with Hydra's runtime
    record too (which option chose each group, which keys the command line set)."""
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data=random", *overrides], return_hydra_config=as_cli)
    if as_cli:
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


@pytest.fixture
def hydra_runtime():
    yield
    HydraConfig.instance().cfg = None


def refused(*overrides, as_cli=False) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        check_config(compose_with(*overrides, as_cli=as_cli))
    return err.value


# ------------------------------------------------------------------ the cases named in issue 11

ISSUE_CASES = [
    (["loader.num_workers=-1"], "loader.num_workers", "loader.num_workers must not be negative"),
    (["+loader.foo=1"], "loader.foo", "loader.foo is not a setting"),
    (["+optim=adamw", "optim.betas=[2,3]"], "optim.betas", "optim.betas[0] must be >= 0 and < 1 (got optim.betas=[2,3])"),
    (["+optim=adamw", "optim.eps=-1"], "optim.eps", "optim.eps must be positive"),
    (["+peft=lora", "peft.alpha=big"], "peft.alpha", "peft.alpha='big' is not a number"),
    (["+engine=ddp", "engine.timeout_s=-1"], "engine.timeout_s", "engine.timeout_s must be positive"),
    ([f"seed={2**64}"], "seed", "seed must be >= 0 and < 2**64"),
    (["loader.pin_memory=maybe"], "loader.pin_memory", "loader.pin_memory='maybe' is not one of auto, true or false"),
    (["lr=inf"], "lr", "lr must be a finite number (got lr=inf)"),
    (["+precision=fp16", "precision.init_scale=0"], "precision.init_scale", "precision.init_scale must be positive"),
]


@pytest.mark.parametrize("overrides,key,message", ISSUE_CASES, ids=[" ".join(c[0]) for c in ISSUE_CASES])
def test_issue_cases_are_refused_at_build_time(overrides, key, message):
    err = refused(*overrides)
    assert err.key == key and message in str(err), str(err)


def test_a_misspelt_top_level_key_names_the_closest_setting():
    err = refused("+batchsize=4")
    assert err.key == "batchsize" and "did you mean batch_size? (e.g. batch_size=4)" in str(err)
    assert "did you mean optim?" in str(refused("+optimm.lr=3"))            # group names are known too
    assert "checkpoint.every_steps" in str(refused("+checkpoint.every=5"))


@pytest.mark.parametrize("overrides,key", [
    (["weight_decay=inf"], "weight_decay"), (["max_grad_norm=nan"], "max_grad_norm"),
    (["+optim=adamw", "optim.eps=nan"], "optim.eps"), (["+optim=sgd", "optim.momentum=-inf"], "optim.momentum"),
    (["+schedule=cosine", "schedule.min_ratio=nan"], "schedule.min_ratio"), (["peak_tflops=inf"], "peak_tflops"),
])
def test_non_finite_numbers_are_refused(overrides, key):
    err = refused(*overrides)
    assert err.key == key and "finite" in str(err)


def test_the_error_names_the_option_that_chose_the_class(hydra_runtime):
    assert "(from optim=adamw)" in str(refused("+optim=adamw", "optim.eps=-1", as_cli=True))
    assert "(from optim=adamw, the default)" in str(refused("+optim.eps=-1", as_cli=True))
    err = refused("+optim=adamw", "optim._target_=looplib.optim.SGD", as_cli=True)  # SGD takes no betas
    assert err.key == "optim.betas"
    assert "is not a setting of looplib.optim.SGD (from optim._target_=looplib.optim.SGD)" in str(err)
    assert "optim=adamw" not in str(err)


# ------------------------------------------------------------------ every shipped option, every key known


def own_node(path):
    """A group file with its defaults list (other options of the same group) merged in, as Hydra does."""
    node = OmegaConf.load(path)
    bases = [d for d in node.pop("defaults", []) if d != "_self_"]
    return OmegaConf.to_container(OmegaConf.merge(*(own_node(path.with_name(f"{d}.yaml")) for d in bases), node))


@pytest.mark.parametrize("path", GROUP_FILES, ids=[f"{p.parent.name}/{p.stem}" for p in GROUP_FILES])
def test_every_yaml_key_is_an_argument_of_its_target(path):
    """A key a class does not take would be refused at build time: no shipped file may hold one."""
    node = own_node(path)
    if path.parent.name == "logger":  # an option's settings sit under its own name (several can be chosen)
        node = node[path.stem]
    target = _locate(node["_target_"])
    params, extra = parameters(target)
    keys = {k for k in node if not k.startswith("_")}
    known = set(params) | (set(target.extra_keys(node)) if hasattr(target, "extra_keys") else set())
    assert keys <= known or (extra and not hasattr(target, "extra_keys")), f"{path}: {keys - known}"
    group = path.parent.name
    prefix = "" if group in ("model", "data", "loss") else "+"
    check_config(compose_with(f"{prefix}{group}={path.stem}"))  # and every value fits its annotation


# ------------------------------------------------------------------ _target_ and the top-level lr / weight_decay


class PlainFactory(lo.OptimizerFactory):
    """A user's factory selected by ``_target_``, taking the top-level settings by name."""

    def __init__(self, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.99)):
        super().__init__(lr, weight_decay)
        self.betas = betas

    def create(self, groups):
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)


class MyAdamW(lo.AdamW):
    pass


def test_a_class_chosen_by_target_receives_the_top_level_lr_and_weight_decay():
    cfg = compose_with("+optim._target_=test_validation.PlainFactory", "lr=0.01", "weight_decay=0.3")
    check_config(cfg)
    factory = instantiate(cfg, "optim")
    assert (factory.lr, factory.weight_decay) == (0.01, 0.3)
    cfg = compose_with("+optim=adamw", "optim._target_=test_validation.MyAdamW", "lr=0.02")
    check_config(cfg)
    factory = instantiate(cfg, "optim")
    assert type(factory) is MyAdamW and (factory.lr, factory.weight_decay, factory.betas) == (0.02, 0.1, (0.9, 0.95))


def test_a_group_given_some_keys_keeps_its_default_option():
    cfg = compose_with("+optim.eps=1e-6")
    check_config(cfg)
    factory = instantiate(cfg, "optim")
    assert type(factory) is lo.AdamW and factory.eps == 1e-6


# ------------------------------------------------------------------ one default, one place


def test_python_and_yaml_defaults_agree():
    from looplib.run.settings import as_config
    top = compose_with()
    assert (top.lr, top.weight_decay) == (lo.LR, lo.WEIGHT_DECAY)
    settings = Settings()
    for name in ("seed", "max_steps", "batch_size", "accum_steps", "lr", "weight_decay", "max_grad_norm"):
        assert getattr(settings, name) == top[name], name
    config = as_config(settings)  # (checkpoint.async: the field asynchronous, under its config key)
    assert config["loader"] == dict(top.loader) and config["checkpoint"] == dict(top.checkpoint)
    for path in sorted((CONF / "optim").glob("*.yaml")) + sorted((CONF / "schedule").glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path))
        params, _ = parameters(_locate(node["_target_"]))
        for key, value in node.items():
            if key.startswith("_"):
                continue
            if value == f"${{{key}}}":  # lr: ${lr} -> the top-level default
                value = top[key]
            default = params[key].default
            assert (list(default) if isinstance(default, tuple) else default) == value, f"{path.name}: {key}"
    from looplib.engines.deepspeed import CPUAdam
    for factory in (lo.AdamW, lo.Adam8bit, CPUAdam):  # the Python classes: the same defaults
        params, _ = parameters(factory)
        assert [params[k].default for k in ("lr", "weight_decay", "betas", "eps")] == [lo.LR, lo.WEIGHT_DECAY,
                                                                                        lo.BETAS, lo.EPS]


# ------------------------------------------------------------------ seeds, planner, the command line


@pytest.mark.parametrize("args", [["--memory-gib", "-4"], ["--memory-gib", "nan"], ["--memory-gib", "lots"],
                                  ["--world-size", "0"], ["--worldsize", "2"]])
def test_bad_planner_arguments_are_one_line(args, capsys):
    assert plan_main([*args, "data=random"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("looplib: error: --"), err


@pytest.mark.parametrize("args,start", [
    (["+batchsize=4"], "looplib: error: batchsize: batchsize is not a setting; did you mean batch_size?"),
    (["+optim=adamw", "optim._target_=looplib.optim.SGD"],
     "looplib: error: optim.betas: optim.betas is not a setting of looplib.optim.SGD (from optim._target_=looplib.optim.SGD)"),
])
def test_the_command_line_refuses_in_one_line(args, start, tmp_path):
    r = run_cli(*args, "data=random", cwd=tmp_path)  # Hydra's own outputs/<date>/<time>
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []  # not even an empty outputs/<date>/
