"""examples/my_research through the command line, from a config directory and by _target_ (the in-process tests: tests/unit/test_examples.py)."""
import json
from pathlib import Path
import torch
from safetensors.torch import load_file

from conftest import run_cli
from test_examples import CONF, EXAMPLE  # noqa: F401 - helpers and fixtures the tests share


ENV = {"PYTHONPATH": str(EXAMPLE)}


QUICK = ["max_steps=4", "batch_size=4", "log_every=1", "eval_every=2", "eval_samples=8", "sample_tokens=8"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run(r, run_dir: Path) -> None:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    cfg = (run_dir / "config.yaml").read_text()
    for target in ("my_research.BF16FP32Norms", "my_research.LionFactory", "my_research.LabelSmoothedLM",
                   "my_research.GRULM", "my_research.ByteCorpus"):
        assert f"_target_: {target}" in cfg, target
    rows = metrics(run_dir)
    train = [m for m in rows if "loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in train)
    assert [m["step"] for m in rows if "eval_loss" in m] == [2, 4]
    weights = load_file(run_dir / "model.safetensors")
    assert "rnn.weight_ih_l0" in weights and weights["embed.weight"].shape[0] == 256
    assert "a sample from the trained model" in r.stdout


def test_every_extension_from_the_users_config_dir(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("--config-dir", str(CONF), "+precision=bf16_fp32_norms", "+optim=lion", "model=gru", "data=bytes",
                "loss=smoothed", "model.seq_len=32", "lr=3e-4", *QUICK, f"hydra.run.dir={run_dir}",
                cwd=tmp_path, env=ENV)
    check_run(r, run_dir)
    log = (run_dir / "train.log").read_text()
    assert "precision bf16-fp32-norms, optimizer Lion" in log


def test_every_extension_by_dotted_path(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("+precision._target_=my_research.BF16FP32Norms",
                "+optim._target_=my_research.LionFactory", "+optim.lr=3e-4",
                "model._target_=my_research.GRULM", "~model.n_head", "~model.pad_vocab_to", "model.n_layer=1", "model.seq_len=32",
                "data._target_=my_research.ByteCorpus", "data.vocab_size=256", "data.max_bytes=100000",
                "loss._target_=my_research.LabelSmoothedLM",
                *QUICK, f"hydra.run.dir={run_dir}", cwd=tmp_path, env=ENV)
    check_run(r, run_dir)


def test_hydra_searchpath_finds_a_new_group_option(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli(f"hydra.searchpath=[file://{CONF}]", "+optim=lion", "data=random", *QUICK,
                f"hydra.run.dir={run_dir}", cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    assert "_target_: my_research.LionFactory" in (run_dir / "config.yaml").read_text()


def test_a_users_config_error_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("--config-dir", str(CONF), "model=gru", "data=bytes", "data.vocab_size=100",
                f"hydra.run.dir={run_dir}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("looplib: error: data.vocab_size"), r.stderr
    assert not run_dir.exists()


def test_a_users_precision_that_deepspeed_would_bypass_is_refused(tmp_path):
    """DeepSpeed casts, scales and steps itself, so a precision of the user's own that overrides
    autocast (BF16FP32Norms) would never be called under +engine=deepspeed: the run trained at
    DeepSpeed's bf16 and exited 0. Now one line naming the class and the verb, exit 2, nothing
    written; looplib's own precisions and a subclass that overrides none of the verbs still pass."""
    from my_research import BF16FP32Norms
    from looplib.engines.deepspeed.precision import DeepSpeedPrecision, bypassed_overrides
    from looplib.precision import BF16

    class Renamed(BF16):  # a new name and settings only: nothing DeepSpeed would bypass
        name = "mine"
    assert bypassed_overrides(Renamed, DeepSpeedPrecision.BYPASSED) == []
    assert bypassed_overrides(BF16FP32Norms, DeepSpeedPrecision.BYPASSED) == ["autocast"]
    run_dir = tmp_path / "run"
    r = run_cli("+precision._target_=my_research.BF16FP32Norms", "+engine=deepspeed", "data=random", *QUICK,
                f"hydra.run.dir={run_dir}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2, r.stderr
    assert "BF16FP32Norms overrides autocast" in r.stderr and "+engine=deepspeed" in r.stderr
    assert "Traceback" not in r.stderr and not (run_dir / "metrics.jsonl").exists()
