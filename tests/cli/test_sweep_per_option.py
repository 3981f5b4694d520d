"""A search that chooses the optimizer gives each option its own learning-rate range (``lr@muon=...``)."""
import json

import pytest

from conftest import run_cli

optuna = pytest.importorskip("optuna", reason="optuna is not installed (pip install 'looplib[optuna]')")

QUICK = ["data=random", "batch_size=2", "max_steps=2", "eval_every=2", "eval_samples=4", "log_every=1",
         "sample_tokens=0", "checkpoint.enabled=false", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
         "model.seq_len=16"]


def test_each_optimizer_is_searched_in_its_own_lr_range(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/sweeper=optuna", "hydra.sweeper.sampler.seed=2", "hydra.sweeper.pruner=none",
                "hydra.sweeper.n_trials=5", "+optim=choice(adamw,muon,sgd)", "lr@muon=tag(log, interval(0.05, 0.1))",
                "lr@adamw=interval(0.0001, 0.0002)", "lr=choice(0.5)", *QUICK, f"hydra.sweep.dir={sweep}",
                cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    trials = optuna.load_study(study_name="looplib", storage=f"sqlite:///{sweep / 'study.db'}").get_trials()
    ranges = {"muon": (0.05, 0.1), "adamw": (1e-4, 2e-4), "sgd": (0.5, 0.5)}  # sgd: the plain lr's range
    seen = set()
    for t in trials:
        option = t.params["+optim"]
        seen.add(option)
        name = "lr" if option == "sgd" else f"lr@{option}"
        assert set(t.params) == {"+optim", name}, t.params  # one lr per trial, its option's
        low, high = ranges[option]
        assert low <= t.params[name] <= high
        rows = [json.loads(line) for line in (sweep / str(t.number) / "metrics.jsonl").read_text().splitlines()]
        assert rows[0]["lr"] == pytest.approx(t.params[name])  # what the job trained with
        assert f"lr={t.params[name]}" in t.user_attrs["overrides"]
    assert seen == {"adamw", "muon", "sgd"}


def test_a_range_for_an_option_no_choice_has_is_refused_in_one_line(tmp_path):
    r = run_cli("-m", "hydra/sweeper=optuna", "+optim=choice(adamw,sgd)", "lr@muon=interval(0.01, 0.1)", *QUICK,
                f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == (
        "looplib: error: lr@muon: no choice(...) parameter has the option(s) muon; add the choice it follows, "
        "e.g. '+optim=choice(muon)'\n")
    assert not (tmp_path / "sweep").exists()
