"""batch_size=auto: the largest micro-batch that fits (multiples of 8), accumulation keeping the
global batch, recovery from an (injected) CUDA out-of-memory error."""
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from looplib.errors import ConfigError
from looplib.cli.main import build_job

from conftest import REPO, run_cli

FAKE = ["model._target_=fake_oom.GPTThatOOMs", "data=random", "model.seq_len=32", "model.n_layer=2"]
QUICK = ["max_steps=2", "log_every=1", "eval_samples=4", "sample_tokens=0"]
ENV = {"PYTHONPATH": str(REPO / "tests")}


def compose_with(*overrides):
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_resolve_recovers_and_leaves_no_trace(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    auto = build_job(compose_with(*FAKE, "+model.oom_above=20", "batch_size=auto", "global_batch_size=64"))
    assert (auto.settings.batch_size, auto.settings.accum_steps) == (16, 4)
    assert (auto.record.config["batch_size"], auto.record.config["accum_steps"]) == (16, 4)  # saved with the run
    assert all(p.grad is None for p in auto.model.parameters())
    rng = torch.random.get_rng_state()
    fixed = build_job(compose_with(*FAKE, "+model.oom_above=20", "batch_size=16", "accum_steps=4",
                                   "global_batch_size=64"))
    assert torch.equal(rng, torch.random.get_rng_state())  # probing consumed no randomness
    for a, b in zip(auto.model.parameters(), fixed.model.parameters()):
        assert torch.equal(a, b)  # and changed no weight


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_auto_trains_like_the_same_sizes_typed_by_hand(tmp_path):
    auto = run_cli(*FAKE, "+model.oom_above=10", "batch_size=auto", "global_batch_size=16", *QUICK,
                   f"hydra.run.dir={tmp_path}/auto", cwd=tmp_path, env=ENV)
    assert auto.returncode == 0, auto.stderr
    log = auto.stdout + auto.stderr
    assert ("batch_size=auto: micro-batch 8 x 2 accumulation steps x 1 process(es) = global batch 16 "
            "(tried 8:fits, 16:out of memory)") in log
    hand = run_cli(*FAKE, "+model.oom_above=10", "batch_size=8", "accum_steps=2", *QUICK,
                   f"hydra.run.dir={tmp_path}/hand", cwd=tmp_path, env=ENV)
    assert hand.returncode == 0, hand.stderr
    a, h = metrics(tmp_path / "auto"), metrics(tmp_path / "hand")
    assert [r["loss"] for r in a if "loss" in r] == [r["loss"] for r in h if "loss" in r]
    assert all(r["samples_per_s"] * r["step_time_s"] == pytest.approx(16) for r in a if "loss" in r)
    assert "batch_size: 8\naccum_steps: 2\nglobal_batch_size: 16" in (tmp_path / "auto" / "config.yaml").read_text()


@pytest.mark.parametrize("args,message", [
    (["batch_size=auto"], "global_batch_size: batch_size=auto needs a target global batch"),
    (["batch_size=auto", "global_batch_size=64", "accum_steps=2"], "accum_steps: batch_size=auto chooses accum_steps"),
    (["batch_size=8", "global_batch_size=30"], "global_batch_size: global_batch_size=30 but batch_size x accum_steps"),
    (["batch_size=many"], "batch_size: batch_size='many' is not a whole number > 0 or auto"),
    (["batch_size=auto", "global_batch_size=0"], "global_batch_size: global_batch_size must be at least 1"),
    (FAKE + ["+model.oom_above=0", "batch_size=auto", "global_batch_size=16"],
     "batch_size: batch_size=auto: not even a micro-batch of 1 fits on cpu"),
])
def test_cli_errors(args, message, tmp_path):
    out = run_cli(*args, *QUICK, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, env=ENV)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"looplib: error: {message}"), out.stderr
    assert not (tmp_path / "run").exists()


def test_settings_error_in_process():
    from looplib.cli.instantiate import check_settings
    with pytest.raises(ConfigError) as err:
        check_settings(compose_with("batch_size=auto"))
    assert err.value.key == "global_batch_size"
