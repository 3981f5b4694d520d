"""hydra/sweeper=optuna (looplib's own sweeper plugin) and the objective every job returns (looplib.cli.sweep):
a TPE study, continued and crashed, pruning, a parallel launcher, bad input, and Hydra's released sweepers."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_cli

optuna = pytest.importorskip("optuna", reason="optuna is not installed (pip install 'looplib[optuna]')")
optuna.logging.set_verbosity(optuna.logging.WARNING)

QUICK = ["model=tiny", "data=random", "batch_size=2", "max_steps=2", "eval_every=1", "eval_samples=4",
         "log_every=1", "sample_tokens=0", "checkpoint.enabled=false"]
TPE = ["-m", "hydra/sweeper=optuna", "lr=tag(log, interval(1e-4, 1e-2))", "+precision=choice(fp32,bf16)",
       "hydra.sweeper.sampler.seed=0", "hydra.sweeper.pruner=none", *QUICK]
ENV = {"OMP_NUM_THREADS": "1"}


def study_of(sweep):
    return optuna.load_study(study_name="looplib", storage=f"sqlite:///{sweep / 'study.db'}")


def final(job_dir, key="eval_loss"):
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r][-1], rows


@pytest.fixture(scope="module")
def tpe_sweep(tmp_path_factory):
    """A 6-trial TPE study over lr and +precision on the tiny model (shared by the tests below)."""
    root = tmp_path_factory.mktemp("tpe")
    r = run_cli(*TPE, "hydra.sweeper.n_trials=6", f"hydra.sweep.dir={root / 'sweep'}", cwd=root, env=ENV)
    assert r.returncode == 0, r.stderr
    return root / "sweep"


def test_a_tpe_study_gets_each_jobs_final_eval_loss(tpe_sweep, tmp_path):
    trials = study_of(tpe_sweep).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6
    assert {t.params["+precision"] for t in trials} <= {"fp32", "bf16"}
    for t in trials:  # what the job returned is what its metrics.jsonl ends with
        value, rows = final(tpe_sweep / str(t.number))
        assert t.value == value and max(r["step"] for r in rows) == 2
        assert 1e-4 <= t.params["lr"] <= 1e-2 and rows[0]["lr"] == pytest.approx(t.params["lr"])
    best = min(trials, key=lambda t: t.value)
    results = (tpe_sweep / "optimization_results.yaml").read_text()
    from omegaconf import OmegaConf
    saved = OmegaConf.load(tpe_sweep / "optimization_results.yaml")
    assert saved.best_value == best.value and saved.best_trial == best.number, results
    assert dict(saved.best_params) == best.params
    assert saved.command.startswith("python -m looplib.train lr=") and "+precision=" in saved.command

    r = run_cli(str(tpe_sweep), "--out", str(tmp_path), module="looplib.report", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "report.md").read_text()
    assert "## Study `looplib`" in md and md.count("| complete |") == 6
    assert f"Best: trial {best.number}, eval_loss {best.value:.6g}" in md and f"    {saved.command}" in md
    for name in ("study_history.png", "study_importances.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_running_again_continues_the_study_and_a_killed_sweep_loses_only_its_trial_in_flight(tpe_sweep):
    before = {t.number: t.value for t in study_of(tpe_sweep).get_trials()}
    cmd = [sys.executable, "-m", "looplib.train", *TPE, "hydra.sweeper.n_trials=8", f"hydra.sweep.dir={tpe_sweep}"]
    proc = subprocess.Popen(cmd, cwd=tpe_sweep.parent, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (tpe_sweep / "7" / ".hydra").exists():  # trial 7 has started: the sweep dies mid-trial
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run_cli(*cmd[3:], cwd=tpe_sweep.parent, env=ENV)  # the same command again
    assert r.returncode == 0, r.stderr
    trials = study_of(tpe_sweep).get_trials()
    assert {t.number: t.value for t in trials[:6]} == before  # the study's finished trials are kept
    states = [t.state.name for t in trials[6:]]
    assert states == ["COMPLETE", "FAIL", "COMPLETE"]  # 8 counted: 2 more than 6, not 8; #7 died with the sweep
    assert trials[7].user_attrs["interrupted"] and trials[8].value == final(tpe_sweep / "8")[0]


def test_a_hopeless_trial_is_pruned_before_its_last_step_and_a_diverged_one_fails(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.sampler.seed=5",
                "lr=choice(0.003,0.5,1e6)", "+hydra.sweeper.pruner_args.n_startup_trials=1", "max_bad_steps=1",
                *QUICK, "max_steps=4", "checkpoint.enabled=true", "checkpoint.every_steps=0",
                f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    trials = study_of(sweep).get_trials()
    assert [(t.params["lr"], t.state.name) for t in trials] == [
        (0.003, "COMPLETE"), (0.5, "PRUNED"), (1e6, "FAIL")]
    value, rows = final(sweep / "1")
    assert rows[-1] == {"step": 1, "pruned": 1} and trials[1].intermediate_values == {1: value}
    assert (sweep / "1" / "checkpoints" / "step-00000001").is_dir()  # saved where it stopped, as on preemption
    assert not (sweep / "1" / "checkpoints" / "step-00000004").exists()
    assert math.isnan(final(sweep / "2", "loss")[0])  # diverged: a failed trial, and the sweep went on
    r = run_cli(str(sweep), "--out", str(tmp_path / "report"), module="looplib.report", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    jobs, study = (tmp_path / "report" / "report.md").read_text().split("## Study")
    table = {row.split(" | ")[0].strip("| "): row for row in jobs.splitlines() if row.startswith("| ")}
    assert table["0"].endswith("| ok |") and table["1"].endswith("| pruned at step 1 |")  # not "ok": it was stopped
    assert "| 1 | pruned |" in study  # and in the study's table


def test_more_failures_than_max_failure_rate_stop_the_sweep_with_exit_1_and_the_study_kept(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=0",
                "hydra.sweeper.pruner=none", "hydra.sweeper.n_trials=3", "hydra.sweeper.max_failure_rate=0.5",
                "lr=choice(1e6,2e6)", "max_bad_steps=1", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ENV)
    assert r.returncode == 1, r.stderr
    said = r.stderr.strip().splitlines()[-1]
    assert said.startswith("looplib: error: hydra.sweeper.max_failure_rate: 1 of the 1 trials this sweep ran "
                           "failed (1 > 0.5), so it stopped"), r.stderr
    assert [t.state.name for t in study_of(sweep).get_trials()] == ["FAIL"]  # not 3: it stopped at once
    r = run_cli("-m", "hydra/sweeper=optuna", "hydra.sweeper.max_failure_rate=2", "lr=choice(1e-3)", *QUICK,
                f"hydra.sweep.dir={tmp_path / 'other'}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2 and r.stderr.startswith("looplib: error: hydra.sweeper.max_failure_rate: 2.0 is not"), r.stderr
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_a_joblib_launcher_runs_trials_in_two_processes_into_one_study(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install hydra-joblib-launcher")
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/sweeper=optuna", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=2", "lr=tag(log, interval(1e-4, 1e-2))", *QUICK,
                f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    trials = study_of(sweep).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    assert len({t.user_attrs["pid"] for t in trials}) == 2  # each reported from its own worker process
    assert [t.value for t in trials] == [final(sweep / str(t.number))[0] for t in trials]


def test_bad_input_is_one_line_exit_2_and_the_study_untouched(tpe_sweep, tmp_path):
    db = (tpe_sweep / "study.db").read_bytes()
    cases = [("lr=tag(log, interval(0, 1e-2))", "lr: 'lr=tag(log, interval(0, 1e-2))' is not a search space"),
             ("sweep.metric=eval_los", "sweep.metric: sweep.metric='eval_los' is not a key of the job's metrics "
                                       "(did you mean eval_loss?)"),
             ("max_steps=3", "holds study 'looplib' of another sweep (max_steps=2 there, max_steps=3 here)")]
    for extra, said in cases:
        r = run_cli(*TPE, extra, f"hydra.sweep.dir={tpe_sweep}", cwd=tmp_path, env=ENV)
        assert r.returncode == 2 and said in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert (tpe_sweep / "study.db").read_bytes() == db
    r = run_cli(*TPE, "lr=interval(1e-2, 1e-4)", f"hydra.sweep.dir={tmp_path / 'new'}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2 and r.stderr.startswith("looplib: error: lr: "), r.stderr
    assert not (tmp_path / "new").exists()


def test_a_sweep_whose_jobs_are_refused_leaves_nothing_behind(tmp_path):
    """max_steps=0 refuses every job: the sweep stops at its first with the job's line and exit 2, and
    leaves neither its directory nor a study whose failed trial would refuse the corrected command as
    "another sweep"."""
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/sweeper=optuna", "lr=tag(log, interval(1e-4, 1e-2))", "hydra.sweeper.n_trials=1",
            "hydra.sweeper.pruner=none", *QUICK, f"hydra.sweep.dir={sweep}"]
    r = run_cli(*args, "max_steps=0", cwd=tmp_path, env=ENV)
    assert r.returncode == 2 and r.stderr == ("looplib: error: max_steps: max_steps must be at least 1 (got "
                                              "max_steps=0); use a whole number of optimizer steps, e.g. "
                                              "max_steps=300\n"), r.stderr
    assert not sweep.exists()
    r = run_cli(*args, cwd=tmp_path, env=ENV)  # corrected
    assert r.returncode == 0, r.stderr
    assert [t.state.name for t in study_of(sweep).get_trials()] == ["COMPLETE"]


def test_without_optuna_the_sweeper_says_what_to_install(tmp_path):
    (tmp_path / "optuna.py").write_text("raise ImportError('No module named optuna')\n")  # as if not installed
    r = run_cli(*TPE, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, env={**ENV, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2 and r.stderr == ("looplib: error: hydra/sweeper=optuna: needs Optuna >= 4 (No module named "
                                              "optuna); pip install 'looplib[optuna]'\n")
    assert not (tmp_path / "sweep").exists()  # (Hydra's plugin scan, which every run makes, got past the plugin)


def test_hydras_nevergrad_sweeper_receives_each_jobs_objective(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_nevergrad_sweeper", reason="hydra-nevergrad-sweeper does not install")
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/sweeper=nevergrad", "hydra.sweeper.optim.budget=2", "hydra.sweeper.optim.num_workers=1",
                "lr=tag(log, interval(1e-4, 1e-2))", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    from omegaconf import OmegaConf
    best = OmegaConf.load(sweep / "optimization_results.yaml").best_evaluated_result
    assert best == min(final(sweep / str(n))[0] for n in range(2))


def test_a_search_whose_metric_cannot_exist_is_refused_before_any_trial(tmp_path):
    """eval_samples=0 turns the held-out evaluation off: the default sweep.metric (eval_loss) would never be
    logged, and every trial would train to its end and fail. Refused in one line, nothing written."""
    sweep = tmp_path / "sweep"
    quick = [a for a in QUICK if not a.startswith("eval_samples=")]
    r = run_cli("-m", "hydra/sweeper=optuna", "lr=tag(log, interval(1e-4, 1e-2))", "hydra.sweeper.n_trials=2",
                *quick, "eval_samples=0", f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ENV)
    assert r.returncode == 2 and r.stderr == (
        "looplib: error: sweep.metric: sweep.metric=eval_loss comes from the held-out evaluation, which eval_samples=0 "
        "turns off: every trial would train to its end without it; give eval_samples (e.g. eval_samples=64, or "
        "null: the whole held-out split), or search another metric (e.g. sweep.metric=loss)\n"), r.stderr
    assert not sweep.exists()
    # a metric every run logs is searched as asked
    r = run_cli("-m", "hydra/sweeper=optuna", "lr=choice(1e-3)", "hydra.sweeper.n_trials=1", "sweep.metric=loss",
                *quick, "eval_samples=0", f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    assert [t.state.name for t in study_of(sweep).get_trials()] == ["COMPLETE"]
