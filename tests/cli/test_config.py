"""Every file under conf/ composes and builds; the packaged config is what the repo holds."""

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import _locate

from looplib import groups
from looplib.cli.instantiate import build_loggers, check_settings, fill_strategy_defaults, instantiate
from looplib.errors import ConfigError

from conftest import REPO, has_bitsandbytes

CONF = REPO / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "__pycache__")
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]
IN_DEFAULTS = {g.name for g in groups.GROUPS if not g.appended}
NEEDS_CUDA = {("precision", "fp8"), ("loss", "lm_liger")}


def compose_with(*overrides):
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_builds(group, option, tmp_path, monkeypatch, request):
    if option == "adam8bit" and not has_bitsandbytes():
        pytest.skip("bitsandbytes is not installed")
    if (group, option) in NEEDS_CUDA and not torch.cuda.is_available():
        pytest.skip("a GPU option: its refusal on the CPU is tested in test_speed.py")
    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path))
    prefix = "" if group in IN_DEFAULTS else "+"
    data = [] if group == "data" else ["data=random"]
    if (group, option) in (("data", "text"), ("data", "instruct"), ("data", "prompts")):  # the user's files: a few records
        rows = "".join(f'{{"text": "{"def f(x): return x " * 40}", "prompt": "p{i}", "completion": "c"}}\n' for i in range(9))
        (tmp_path / "records.jsonl").write_text(rows)
        data = [f"data.path={tmp_path / 'records.jsonl'}", "data.eval_fraction=0"]
    if (group, option) == ("data", "preference"):  # pairs
        rows = "".join(f'{{"prompt": "p{i}", "chosen": " yes {i}", "rejected": " no"}}\n' for i in range(9))
        (tmp_path / "pairs.jsonl").write_text(rows)
        data = [f"data.path={tmp_path / 'pairs.jsonl'}", "data.eval_fraction=0"]
    if (group, option) == ("data", "tokens"):  # nanoGPT's layout: uint16 ids, documents ended by 50256
        import array
        ids = array.array("H", ([i % 500 for i in range(300)] + [50256]) * 9)
        (tmp_path / "train.bin").write_bytes(ids.tobytes())
        data = [f"data.path={tmp_path / 'train.bin'}", "data.eval_fraction=0"]
    if group == "model" and option.startswith("hf"):  # a pretrained directory is what they load
        data += [f"model.path={request.getfixturevalue('tiny_pretrained')}", "model.seq_len=16"]
    cfg = compose_with(f"{prefix}{group}={option}", *data)
    check_settings(cfg)
    fill_strategy_defaults(cfg)
    if group == "logger":  # each option sits under its own name (logger.<option>), so several can be chosen
        pytest.importorskip(option)
        [obj] = build_loggers(cfg).loggers
        assert type(obj) is _locate(cfg.logger[option]._target_)
        return
    obj = instantiate(cfg, group)
    assert type(obj) is _locate(cfg[group]._target_)
    if group == "model":
        assert sum(p.numel() for p in obj.parameters()) > 0
    if group == "precision":
        obj.setup(torch.device("cpu"))


def test_strategy_groups_stay_out_of_the_defaults_list():
    cfg = compose_with()
    for group in groups.appended_defaults():
        assert group not in cfg, f"{group} in the defaults list would break +{group}=..."
    fill_strategy_defaults(cfg)
    assert cfg.precision._target_ == "looplib.precision.FP32"
    assert cfg.optim._target_ == "looplib.optim.AdamW" and cfg.optim.lr == cfg.lr
    assert cfg.schedule._target_ == "looplib.schedule.Constant"


@pytest.mark.parametrize("key,value,message", [
    ("max_steps", "abc", "max_steps='abc' is not a whole number"),
    ("max_steps", "1e3", "max_steps=1000.0 is a float, not a whole number (write max_steps=1000)"),
    ("batch_size", "8.0", "batch_size=8.0 is a float, not a whole number (write batch_size=8)"),
    ("accum_steps", 0, "accum_steps must be at least 1"),
    ("batch_size", -1, "batch_size must be at least 1"),
    ("lr", -1, "lr must be positive"),
    ("lr", "fast", "lr='fast' is not a number"),
    ("max_grad_norm", -2.0, "max_grad_norm must not be negative"),
    ("progress", "loud", "progress='loud' is not one of auto, bar or lines"),
])
def test_settings_errors_name_the_key(key, value, message):
    cfg = compose_with(f"{key}={value}")
    with pytest.raises(ConfigError) as err:
        check_settings(cfg)
    assert err.value.key == key and message in str(err.value)


def test_settings_convert_strings():
    s = check_settings(compose_with("max_steps=12", "lr=1e-4", "max_grad_norm=null"))
    assert s.max_steps == 12 and s.lr == 1e-4 and s.max_grad_norm is None


def test_the_saved_config_records_no_top_level_lr_that_nothing_used():
    """``optim.lr=0.01`` given directly leaves the top-level ``lr`` unused: config.yaml records what ran
    (as a Python run's does); a top-level lr the optimizer interpolates stays, and so does weight_decay
    when the optimizer takes it from there."""
    from looplib.cli.main import used
    direct = used(compose_with("+optim=adamw", "optim.lr=0.01"))
    assert "lr" not in direct and direct["optim"]["lr"] == 0.01 and direct["weight_decay"] == direct["optim"]["weight_decay"]
    both = used(compose_with("+optim=adamw", "optim.lr=0.01", "optim.weight_decay=0.0"))
    assert "lr" not in both and "weight_decay" not in both and both["optim"]["weight_decay"] == 0.0
    plain = used(compose_with("+optim=adamw", "lr=0.004"))
    assert plain["lr"] == plain["optim"]["lr"] == 0.004
