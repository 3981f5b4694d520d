"""End to end through the command line, as users type it."""
import json
from pathlib import Path

import pytest

from conftest import has_bitsandbytes, run_cli

QUICK = ["max_steps=6", "batch_size=4", "log_every=2", "eval_every=3", "eval_samples=8", "sample_tokens=8"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_job_shortened(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    r = run_cli(*QUICK, f"hydra.run.dir={run_dir}", cwd=tmp_path, env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 0, r.stderr
    rows = metrics(run_dir)
    train = [m for m in rows if "loss" in m]
    assert [m["step"] for m in train] == [1, 2, 4, 6]
    for m in train:
        assert {"step", "loss", "lr", "step_time_s", "tokens_per_s", "samples_per_s"} <= set(m)
        assert m["tokens_per_s"] > 0 and m["lr"] == pytest.approx(2e-3)
    evals = [m for m in rows if "eval_loss" in m]
    assert [m["step"] for m in evals] == [3, 6]
    assert evals[-1]["eval_perplexity"] == pytest.approx(2.718281828 ** evals[-1]["eval_loss"], rel=1e-6)
    assert (run_dir / "model.safetensors").stat().st_size > 0
    cfg = (run_dir / "config.yaml").read_text()
    assert "_target_: looplib.precision.FP32" in cfg and "_target_: looplib.optim.AdamW" in cfg
    assert "a sample from the trained model" in r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(not has_bitsandbytes(), reason="bitsandbytes is not installed")
def test_bf16_adam8bit_line_as_typed(tmp_path, token_cache):
    run_dir = tmp_path / "run"
    r = run_cli("+precision=bf16", "+optim=adam8bit", *QUICK, f"hydra.run.dir={run_dir}",
                cwd=tmp_path, env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 0, r.stderr
    cfg = (run_dir / "config.yaml").read_text()
    assert "looplib.precision.BF16" in cfg and "looplib.optim.Adam8bit" in cfg
    assert len([m for m in metrics(run_dir) if "loss" in m]) == 4


def test_lr_override_reaches_every_optimizer(tmp_path, token_cache):
    for extra in ([], ["+optim=sgd"]):
        run_dir = tmp_path / f"run{len(extra)}"
        r = run_cli(*extra, "lr=0.0123", "data=random", *QUICK, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert metrics(run_dir)[0]["lr"] == pytest.approx(0.0123)


def test_multirun_four_jobs(tmp_path):
    optims = "adamw,adam8bit" if has_bitsandbytes() else "adamw,sgd"
    # -m among the overrides, as people type it after the fact (Hydra's parser alone refuses that)
    # and a key of the swept group set once for every job (Hydra alone wants ++optim.lr there)
    r = run_cli("+precision=fp32,bf16", "-m", f"+optim={optims}", "optim.lr=0.0123", "max_steps=5", "data=random",
                "batch_size=4", "log_every=5", "eval_samples=4",  # a sweep's jobs: no sample unless asked
                f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    seen = set()
    for job in jobs:
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        seen.add(overrides)
        assert metrics(job)[-1]["step"] == 5 and metrics(job)[0]["lr"] == pytest.approx(0.0123)
        assert (job / "model.safetensors").exists()
        assert "\nsample_tokens: 0\n" in (job / "config.yaml").read_text() and not (job / "sample.txt").exists()
    assert len(seen) == 4


@pytest.mark.parametrize("mode,task,expected", [("MULTIRUN", ["lr=1e-3"], 0), ("MULTIRUN", ["sample_tokens=7"], 7),
                                                ("RUN", [], 160)])
def test_a_sweeps_jobs_sample_only_when_the_command_line_asks(mode, task, expected):
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf
    from looplib.cli.sweep import no_sample_unless_asked
    hydra = OmegaConf.merge(OmegaConf.structured(HydraConf), {"mode": mode, "overrides": {"task": task}})
    HydraConfig.instance().set_config(OmegaConf.create({"hydra": hydra}))
    cfg = OmegaConf.create({"sample_tokens": 7 if task == ["sample_tokens=7"] else 160})
    no_sample_unless_asked(cfg)
    assert cfg.sample_tokens == expected


BAD = [
    (["accum_steps=0"], "accum_steps"),
    (["batch_size=-1"], "batch_size"),
    (["lr=-1"], "lr"),
    (["max_steps=abc"], "max_steps"),
    (["+precision=fp16", "device=meta"], "precision"),
    (["device=cuda:0"] if not __import__("torch").cuda.is_available() else ["device=nope"], "device"),
    (["+optim=adamw", "optim._target_=no_such_pkg.Optimizer"], "optim._target_"),
    (["model._target_=looplib.models.NoSuchModel"], "model._target_"),
]


@pytest.mark.parametrize("args,key", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_line_exit_2_no_run_dir(tmp_path, args, key):
    run_dir = tmp_path / "run"
    r = run_cli(*args, "data=random", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"looplib: error: {key}"), lines[0]
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_adam8bit_without_bitsandbytes(tmp_path):
    fake = tmp_path / "fake" / "bitsandbytes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named bitsandbytes')\n")
    run_dir = tmp_path / "run"
    r = run_cli("+optim=adam8bit", "data=random", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                env={"PYTHONPATH": str(tmp_path / "fake")})
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'looplib[bnb]'" in lines[0], r.stderr
    assert not run_dir.exists()


def test_bad_input_leaves_an_existing_run_dir_alone(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("precious")
    r = run_cli("lr=-1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2
    assert (run_dir / "keep.txt").read_text() == "precious"
