"""Muon through the command line and tune (the in-process tests: tests/unit/test_muon.py)."""
import pytest
import torch

from conftest import run_cli


@pytest.mark.parametrize("args, line", [
    (["+optim=muon", "optim.ns_steps=0"],
     "looplib: error: optim.ns_steps: optim.ns_steps must be >= 1 and <= 99 (got optim.ns_steps=0) (from optim=muon); "
     "use a whole number >= 1 and <= 99, e.g. optim.ns_steps=5 (the default)"),
    (["+optim=muon", "optim.adjust_lr=rms"],
     "looplib: error: optim.adjust_lr: optim.adjust_lr='rms' is not one of original or match_rms_adamw (from "
     "optim=muon); use one of original or match_rms_adamw, e.g. optim.adjust_lr=match_rms_adamw (the default)"),
    (["+optim=muon", "+peft=lora"],
     "looplib: error: optim: +optim=muon with +peft=lora: Muon orthogonalises whole weight matrices, and an adapter "
     "trains low-rank factors of a frozen base (not what Muon's update is defined or tuned for); use +optim=adamw "
     "with LoRA/QLoRA, or train the whole model with +optim=muon"),
    (["+schedule=wsd", "schedule.decay_fraction=1.5"],
     "looplib: error: schedule.decay_fraction: schedule.decay_fraction must be >= 0 and <= 1 (got "
     "schedule.decay_fraction=1.5) (from schedule=wsd); use a number >= 0 and <= 1, e.g. "
     "schedule.decay_fraction=0.2 (the default)"),
    (["+schedule=wsd", "schedule.decay_shape=sqrt"],
     "looplib: error: schedule.decay_shape: schedule.decay_shape='sqrt' is not one of linear, cosine or 1-sqrt "
     "(from schedule=wsd); use one of linear, cosine or 1-sqrt, e.g. schedule.decay_shape=linear (the default)"),
])
def test_bad_keys_get_one_line_and_exit_2(tmp_path, args, line):
    r = run_cli("data=random", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert (r.returncode, r.stderr.strip(), r.stdout) == (2, line, "")
    assert not (tmp_path / "run").exists()


def test_tune_searches_muon_with_numerics_allowed_and_checks_it_against_the_jobs_loss(tmp_path):
    from looplib.tune.space import device_options
    assert "muon" in device_options(torch.device("cpu"), 1, "looplib.loss.TokenCrossEntropy")["optim"]
    from test_tune import BARE, TINY, tune
    r, result = tune(tmp_path, "m", *TINY, "batch_size=4", "tune.search=[optim]", "tune.numerics=allow",
                     "tune.options.optim=[muon]", *BARE, "tune.steps=1", "tune.repeats=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert result["dimensions"] == {"optim": ["adamw", "muon"]}
    row = next(x for x in result["rows"] if x["candidate"] == "optim=muon")
    assert row["overrides"] == ["+optim=muon"]
    assert row["status"] in ("measured", "diverged") and row["loss_delta"] is not None  # its loss against the job's
    r, _ = tune(tmp_path, "k", *TINY, "batch_size=4", "tune.search=[optim]", "tune.options.optim=[muon]")
    assert r.returncode == 2 and "tune.options.optim: optim is searched only with tune.numerics=allow" in r.stderr
