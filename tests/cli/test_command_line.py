"""The command line forgives and explains (issue 21): both spellings of a group, Hydra's refusals as
looplib's one line (exit 2, nothing written), resume=auto without a run directory, small data said,
stdout for progress and stderr for problems, the sample saved and stopped at once by a signal."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli

TINY = ["data=random", "data.n_train=64", "data.n_eval=8", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "model.seq_len=16", "batch_size=4", "log_every=1", "eval_every=0", "eval_samples=4", "sample_tokens=0",
        "checkpoint.enabled=false", "progress=lines", "max_steps=2"]
ENV = {"OMP_NUM_THREADS": "1"}


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def everything(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_both_spellings_of_a_group_make_the_same_config():
    """precision=bf16 and +precision=bf16 (a strategy group), model=tiny and +model=tiny (a job group):
    the same composed config, so the same config.yaml."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from looplib.cli.args import normalise
    configs = []
    for spelled in (["precision=bf16", "+model=tiny"], ["+precision=bf16", "model=tiny"]):
        with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
            configs.append(OmegaConf.to_yaml(compose(config_name="config", overrides=normalise([*spelled, *TINY]))))
    assert "_target_: looplib.precision.BF16" in configs[0]
    assert configs[0] == configs[1]


KEYS = [  # Hydra's "use +key=value" followed, then looplib's check names the closest setting (in the job)
    (["max_step=10"], "max_step: ", "did you mean max_steps?"),
    (["model.n_layr=3"], "model.n_layr: ", "did you mean model.n_layer?"),
    # a group's setting typed at the top level: the group named
    (["+optim=sgd", "momentum=0.8"], "momentum: ", "a setting of optim; write optim.momentum=0.8"),
    (["n_layer=4"], "n_layer: ", "write model.n_layer=4"),
]


@pytest.mark.parametrize("args,start,names", KEYS, ids=[" ".join(a) for a, _, _ in KEYS])
def test_an_unknown_key_with_or_without_plus_is_one_line_exit_2_nothing_written(tmp_path, args, start, names):
    r = run_cli(*args, "data=random", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(lines(r.stderr)) == 1 and lines(r.stderr)[0].startswith(f"looplib: error: {start}"), r.stderr
    assert names in r.stderr and "Traceback" not in r.stderr
    assert everything(tmp_path) == []  # no outputs/, no .hydra/, nothing


def refused_here(args: list[str], capsys) -> str:
    """``python -m looplib.train ARGS`` in this process, for arguments refused before a job starts:
    exit status 2 and the one line on stderr (returned)."""
    from looplib import cli
    from looplib.cli.main import main
    with pytest.raises(SystemExit) as stop:
        cli.run(main, args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(lines(err)) == 1 and err.startswith("looplib: error: "), err
    assert "HYDRA_FULL_ERROR" not in os.environ
    return err.strip()


REFUSED = [  # refused by Hydra as it composes: checked in this process (no job starts)
    (["+optim=adam"], "optim: there is no option 'adam'", "did you mean adamw or adam8bit"),
    (["optim=adam"], "optim: there is no option 'adam'", "(+optim=adamw)"),
    (["model=gpt"], "model: there is no option 'gpt'", "(model=gpt2_small)"),
    (["lr=1e-3,3e-4"], "lr: 'lr=1e-3,3e-4' holds several values", "add -m"),
    (["lr=[1e-3"], "lr: cannot read the argument 'lr=[1e-3'", "override_grammar"),
    # a typo in one of Hydra's own nodes: the closest key, or the option of the group that has it
    (["hydra.run.dri=x"], "hydra.run.dri: dri is not a setting of hydra.run", "did you mean hydra.run.dir?"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trial=3", "lr=1e-3"], "hydra.sweeper.n_trial: ",
     "did you mean hydra.sweeper.n_trials?"),
    (["-m", "hydra.sweeper.n_trials=3", "lr=1e-3"], "hydra.sweeper.n_trials: ",
     "n_trials is a setting of hydra/sweeper=optuna: choose it"),
    # a grid sweep's every job is checked before the first runs: not after job 0 has trained
    (["-m", "lr=1e-3,-1"], "lr: lr must be positive (got lr=-1) (in job 1 of the 2: lr=-1 ",
     "; no job of the sweep has run"),
    (["-m", "batch_size=4,0", "+optim=adamw,sgd"], "batch_size: batch_size must be at least 1",
     "(in job 2 of the 4: batch_size=0 +optim=adamw "),
    (["-m", "+optim=sgd,adamw", "optim.lr=-1"], "optim.lr: ", "(from optim=sgd) (in job 0 of the 2: +optim=sgd "),
]


@pytest.mark.parametrize("args,start,names", REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_hydras_refusals_are_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capsys, args, start, names):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    line = refused_here([*args, "data=random"], capsys)
    assert line.startswith(f"looplib: error: {start}") and names in line, line
    assert everything(tmp_path) == []


@pytest.mark.parametrize("value", [None, "0"], ids=["unset", "0"])
def test_hydra_full_error_unset_or_0_is_looplibs_one_line(tmp_path, monkeypatch, capsys, value):
    """HYDRA_FULL_ERROR keeps Hydra's meaning: unset or 0 (Hydra's default), looplib's line and exit 2;
    looplib never changes the variable."""
    from looplib import cli
    from looplib.cli.main import main
    monkeypatch.chdir(tmp_path)
    if value is None:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    else:
        monkeypatch.setenv("HYDRA_FULL_ERROR", value)
    for args, start in ((["max_step=3"], "max_step: max_step is not a setting; did you mean max_steps?"),
                        (["model=nonexistent"], "model: there is no option 'nonexistent'")):
        with pytest.raises(SystemExit) as stop:
            cli.run(main, [*args, "data=random"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and lines(err) == [lines(err)[0]] and err.startswith(f"looplib: error: {start}"), err
        assert os.environ.get("HYDRA_FULL_ERROR") == value
    assert everything(tmp_path) == []


@pytest.mark.parametrize("where", ["/proc/looplib-x", "FILE/sub"])
def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys, where):
    from looplib import cli
    from looplib.cli.main import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file")
    with pytest.raises(SystemExit) as stop:
        cli.run(main, [f"hydra.run.dir={where}", "data=random"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(lines(err)) == 1 and "Traceback" not in err, err
    assert err.startswith("looplib: error: hydra.run.dir: cannot "), err
    assert everything(tmp_path) == ["FILE"]


def test_hydra_full_error_still_shows_hydras_report(tmp_path, monkeypatch, capsys):
    from hydra.errors import MissingConfigException

    from looplib import cli
    from looplib.cli.main import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(MissingConfigException, match="Could not find 'optim/adam'"):  # Hydra's own, with its traceback
        cli.run(main, ["+optim=adam", "data=random"])
    assert "looplib: error" not in capsys.readouterr().err
    assert os.environ["HYDRA_FULL_ERROR"] == "1" and everything(tmp_path) == []


def test_a_refused_multirun_leaves_no_sweep_directory(tmp_path, monkeypatch, capsys):
    r = run_cli("-m", "lr=[1e-3,3e-4]", *TINY, cwd=tmp_path, env=ENV)  # refused by looplib in the job
    assert r.returncode == 2, r.stderr
    assert len(lines(r.stderr)) == 1 and r.stderr.startswith("looplib: error: lr: "), r.stderr
    assert everything(tmp_path) == []  # no multirun/<date>/<time>/multirun.yaml
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    refused_here(["-m", "+optim=adam,sgd", *TINY], capsys)  # refused by Hydra as the sweep starts
    assert everything(tmp_path) == []


def test_resume_auto_without_a_run_directory_names_the_run_to_continue(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert "no run under outputs/ has a checkpoint" in refused_here(["resume=auto", *TINY], capsys)
    assert everything(tmp_path) == []

    saved = [a for a in TINY if not a.startswith(("checkpoint.", "max_steps"))] + ["max_steps=1"]
    r = run_cli(*saved, cwd=tmp_path, env=ENV)  # a run with a checkpoint, in outputs/
    assert r.returncode == 0, r.stderr
    [earlier] = [p.relative_to(tmp_path) for p in (tmp_path / "outputs").glob("*/*")]
    before = everything(tmp_path)
    line = refused_here(["resume=auto", "max_steps=2"], capsys)
    assert f"the most recent run with a checkpoint is {earlier} (step 1)" in line
    assert everything(tmp_path) == before  # no new run directory: never a silent fresh start
    # the command named is that run's own overrides with what was typed now, and it continues the run
    command = [a for a in saved if not a.startswith("max_steps")] + ["max_steps=2", "resume=auto",
                                                                     f"hydra.run.dir={earlier}"]
    assert line.endswith("continue it with: python -m looplib.train " + " ".join(command)), line
    r = run_cli(*command, cwd=tmp_path, env=ENV)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout + r.stderr
    assert [json.loads(x)["step"] for x in (tmp_path / earlier / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in x] == [1, 2]


def test_progress_on_stdout_problems_on_stderr_small_data_said_sample_saved(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli(*TINY, "data.n_train=3", "batch_size=32", "accum_steps=4", "sample_tokens=6",
                f"hydra.run.dir={run_dir}", cwd=tmp_path, env={**ENV, "LOOPLIB_PLOT": "1"})
    assert r.returncode == 0, r.stderr
    [warning] = lines(r.stderr)  # the one problem, on stderr only
    assert "[WARNING] - small data: batch_size=32 is larger than the 3 training sequences" in warning
    assert "fewer than accum_steps=4" in warning and "3 x 4 sequences" in warning
    assert "small data" not in r.stdout
    assert "steps 1-2 of 3 x 4 sequences" in r.stdout and "step 2/2" in r.stdout  # the real micro-batch
    sample = (run_dir / "sample.txt").read_text()
    assert sample.strip() and sample.strip() in r.stdout
    if importlib.util.find_spec("matplotlib"):  # the single run's loss curve, at the end and on demand
        assert (run_dir / "loss.png").stat().st_size > 0
        from looplib import report
        assert report.main([str(run_dir), "--out", str(tmp_path / "again")]) == 0
        assert (tmp_path / "again" / "loss.png").stat().st_size > 0
    else:
        assert not (run_dir / "loss.png").exists()


def test_a_signal_during_the_sample_stops_it_at_once_and_the_run_ends_as_done(tmp_path):
    """The sample would take hours; SIGTERM while it runs ends the run as finished (exit 0)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "looplib.train", *TINY, "sample_tokens=100000000",
                             f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                            env={**os.environ, "PYTHONWARNINGS": "ignore", **ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "sampling 100000000 tokens" in line:
            break
    time.sleep(0.5)  # well inside the sample
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "done: " in out and "Traceback" not in out
    assert (run_dir / "model.safetensors").exists() and not (run_dir / "sample.txt").exists()
    assert [json.loads(x)["status"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "status" in json.loads(x)][-1:] in ([], ["finished"])


def test_a_state_file_of_another_pickle_protocol_is_refused_without_torchs_warning(tmp_path):
    import warnings

    import torch

    from looplib.errors import ConfigError
    from looplib.store.checkpoint_dir import load_state
    path = tmp_path / "state.pt"
    torch.save({"step": torch.tensor(3)}, path, pickle_protocol=4)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(ConfigError, match="resume: .*state.pt"):
        warnings.simplefilter("always")
        load_state(path)
    assert [str(w.message) for w in seen] == []


def test_normalise_adds_or_drops_only_the_plus_of_a_group():
    from looplib.cli.args import normalise
    typed = ["-m", "precision=fp32,bf16", "+model=tiny", "optim=choice(adamw,sgd)", "+engine=ddp", "lr=range(1,3)",
             "++max_steps=3", "~loss", "+model.n_layer=2", "schedule=[cosine]", "--config-dir", "precision=x",
             "hydra.run.dir=x", "data=random", "max_steps=1"]
    assert normalise(typed) == ["-m", "--config-dir", "precision=x", "+precision=fp32,bf16", "model=tiny",
                                "+optim=choice(adamw,sgd)", "+engine=ddp", "lr=range(1,3)", "++max_steps=3", "~loss",
                                "+model.n_layer=2", "+schedule=[cosine]", "hydra.run.dir=x", "data=random", "max_steps=1"]
    assert normalise(["--config-name", "mine", "precision=bf16"]) == ["--config-name", "mine", "precision=bf16"]
    # a strategy group given twice: the last wins, as Hydra has it for settings and the job's groups
    assert normalise(["+precision=bf16", "max_steps=2", "precision=fp16", "+optim=sgd", "+precision.x=1"]) == [
        "max_steps=2", "+precision=fp16", "+optim=sgd", "+precision.x=1"]
    # Hydra's flags go first: its parser takes the overrides as one run of words
    assert normalise(["max_steps=2", "-m", "lr=1,2", "--cfg", "job", "--info", "defaults", "x=1"]) == [
        "-m", "--cfg", "job", "--info", "defaults", "max_steps=2", "lr=1,2", "x=1"]


def test_the_console_script_goes_through_the_same_layer(tmp_path):
    script = Path(sys.executable).parent / "looplib-train"
    if not script.exists():
        pytest.skip("looplib-train is not installed beside this Python")
    r = subprocess.run([str(script), "optim=adam", "data=random"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert r.returncode == 2, r.stderr
    [line] = lines(r.stderr)
    assert line.startswith("looplib: error: optim: there is no option 'adam'; did you mean adamw or adam8bit "
                           "(+optim=adamw)? the options are: "), line
    assert everything(tmp_path) == []


def test_the_plus_is_decided_by_the_config_not_by_hydras_message():
    """``settle`` (before Hydra runs): a strategy group gets its ``+``; a key the composed config lacks
    is appended (``++`` under a strategy group: added, or set where the option has it), also where
    a sweep switches the group (the sweep's own config has no option yet); a ``+key`` the config has
    set loses its ``+``; Hydra's own keys, deletions and values stay as typed."""
    from looplib.cli.args import settle
    assert settle(["precision=bf16", "max_step=3", "+max_steps=2", "optim.lr=1e-3", "+global_batch_size=8",
                   "model.n_layr=2", "model.n_layer=2", "hydra.run.dir=x", "seed=1"]) == [
        "+precision=bf16", "+max_step=3", "max_steps=2", "++optim.lr=1e-3", "+global_batch_size=8",
        "+model.n_layr=2", "model.n_layer=2", "hydra.run.dir=x", "seed=1"]
    assert settle(["+optim=sgd", "optim.lr=1e-3", "optim.momentum=0.8"]) == [
        "+optim=sgd", "optim.lr=1e-3", "optim.momentum=0.8"]
    assert settle(["-m", "optim=sgd,adamw", "optim.lr=1e-3", "lr=1,2"]) == [
        "-m", "+optim=sgd,adamw", "++optim.lr=1e-3", "lr=1,2"]
    # a user's config directory: its groups and options are the repository's too (examples/my_research)
    conf = str(Path(__file__).parents[2] / "examples" / "my_research" / "conf")
    assert settle(["--config-dir", conf, "optim=lion", "model=gru", "max_step=3"]) == [
        "--config-dir", conf, "+optim=lion", "model=gru", "+max_step=3"]
    from looplib.cli.args import Refusal
    with pytest.raises(Refusal, match=r"^optim: there is no option 'lionn'; did you mean lion \(\+optim=lion\)\? "):
        settle(["--config-dir", conf, "optim=lionn"])


@pytest.mark.parametrize("args,line", [
    (["-m", "+optim=sgd,adamm"], "optim: there is no option 'adamm'; did you mean adamw or adam8bit (+optim=adamw)? "),
    (["-m", "model=tiny,gpt2_smal"], "model: there is no option 'gpt2_smal'; did you mean gpt2_small (model=gpt2_small)? "),
    (["hydra/launcher=jobllib"], "hydra/launcher: there is no option 'jobllib'; did you mean joblib "),
    (["precision=[bf16"], "precision: cannot read the argument '+precision=[bf16'"),
    (["seed=range(1,3)"], "seed: 'seed=range(1,3)' is a sweep; add -m to run one job per value"),
])
def test_refusals_found_before_hydra_runs_with_a_hint(args, line):
    """Every option a sweep names is checked (not only the first value Hydra composes first), the
    closest option named from the config repository's own list; several values without -m said."""
    from looplib.cli.args import Refusal, settle
    with pytest.raises(Refusal) as refused:
        settle(args)
    assert refused.value.line.startswith(line), refused.value.line


def test_no_private_hydra_api_and_no_hydra_message_read():
    """Issue 42: looplib uses Hydra's public API only (no hydra._internal, no patched Hydra function)
    and reads no Hydra error text (no pattern over Hydra's wording)."""
    import looplib
    root = Path(looplib.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        for bad in ("hydra._internal", "_save_config", "run_and_report", "BOUNDARY", "Could not override",
                    "Ambiguous value", "To append to your"):
            if bad in text:
                found.append(f"{path.relative_to(root)}: {bad}")
    assert found == []
