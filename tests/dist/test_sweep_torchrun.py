"""hydra/sweeper=optuna under torchrun (2 CPU processes, gloo): one configuration per trial, a best
command that names its launcher and trains the best trial's global batch, a study that continues
only on the processes and global batch it was run with, and refusals that every rank says."""
import json
import shlex

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import run_cli
from looplib.process.launcher import free_port

optuna = pytest.importorskip("optuna", reason="optuna is not installed (pip install 'looplib[optuna]')")
optuna.logging.set_verbosity(optuna.logging.WARNING)

JOB = ["data=random", "max_steps=3", "log_every=1", "eval_every=3", "eval_samples=4", "sample_tokens=0",
       "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "accum_steps=2",
       "checkpoint.enabled=false", "batch_size=2"]
SWEEP = ["-m", "+engine=ddp", "hydra/sweeper=optuna", "lr=tag(log, interval(1e-3, 1e-1))", "hydra.sweeper.n_trials=3",
         "hydra.sweeper.pruner=none", "hydra.sweeper.sampler.seed=1", *JOB]
TORCHRUN = "torchrun --nproc_per_node 2"


def torchrun(*args, cwd, env=None):
    return run_cli("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "looplib.train", *args, cwd=cwd,
                   module="torch.distributed.run", env={"PYTHONFAULTHANDLER": "1", **(env or {})})


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def study_of(sweep):
    return optuna.load_study(study_name="looplib", storage=f"sqlite:///{sweep / 'study.db'}")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Three trials under torchrun (global batch 2 x 2 accumulation x 2 processes = 8)."""
    root = tmp_path_factory.mktemp("torchrun_sweep")
    r = torchrun(*SWEEP, f"hydra.sweep.dir={root / 'sweep'}", cwd=root)
    assert r.returncode == 0, r.stderr
    return root, root / "sweep"


def test_an_optuna_search_under_torchrun_trains_one_configuration_per_trial(swept):
    """Rank 0 alone asks the study and touches its storage; the other rank trains what it is handed.
    Each trial's weights equal a one-process run of the same overrides (with a different lr on
    rank 1, DDP would average gradients of two different runs, and they would not)."""
    root, sweep = swept
    trials = study_of(sweep).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3 and len({t.params["lr"] for t in trials}) == 3
    assert list(sweep.glob("*.db")) == [sweep / "study.db"]  # one study, no rank's own
    lr = trials[0].params["lr"]
    assert rows(sweep / "0" / "metrics.jsonl")[0]["lr"] == pytest.approx(lr)
    one = root / "one"
    r = run_cli(*JOB, "batch_size=4", f"lr={lr}", f"hydra.run.dir={one}", cwd=root)
    assert r.returncode == 0, r.stderr
    a, b = load_file(sweep / "0" / "model.safetensors"), load_file(one / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=0)  # (test_engines_ddp's WEIGHT_ATOL)


def test_the_best_command_names_its_launcher_and_trains_the_best_trials_global_batch(swept):
    """optimization_results.yaml's command (one line) and the report's "Run it again" start with
    torchrun and its process count; run as printed, it trains the best trial again: the same global
    batch, recorded in its config.yaml and first metrics row, and the same held-out loss."""
    root, sweep = swept
    study = study_of(sweep)
    best = study.best_trial
    text = (sweep / "optimization_results.yaml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("command: "))
    command = line.removeprefix("command: ")
    assert yaml.safe_load(text)["command"] == command  # the whole value on its one line: it pastes
    assert command.startswith(f"{TORCHRUN} -m looplib.train lr=") and "+engine=ddp" in command
    assert study.user_attrs["looplib_geometry"] == {"world_size": 2, "launcher": TORCHRUN, "global_batch": 8}
    job = sweep / str(best.number)
    first = rows(job / "metrics.jsonl")[0]
    assert (first["world_size"], first["launcher"], first["global_batch"]) == (2, TORCHRUN, 8)
    assert yaml.safe_load((job / "config.yaml").read_text())["launch"] == {
        "launcher": TORCHRUN, "world_size": 2, "batch_size": 2, "accum_steps": 2, "global_batch": 8}

    words = shlex.split(command)
    assert words[:3] == ["torchrun", "--nproc_per_node", "2"]
    again = root / "again"
    r = torchrun(*words[5:], f"hydra.run.dir={again}", cwd=root)  # as printed (and a free port)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((again / "config.yaml").read_text())["launch"]["global_batch"] == 8
    assert [x["eval_loss"] for x in rows(again / "metrics.jsonl") if "eval_loss" in x][-1] == pytest.approx(
        best.value, rel=1e-6)

    r = run_cli(str(sweep), "--out", str(root / "report"), module="looplib.report", cwd=root)
    assert r.returncode == 0, r.stderr
    md = (root / "report" / "report.md").read_text()
    assert f"Run it again on its own with:\n\n    {command}\n" in md
    assert f"Every job ran on 2 processes ({TORCHRUN}), global batch 8." in md


def test_a_second_sweep_into_the_study_under_torchrun_is_one_line_on_every_rank(swept, tmp_path):
    root, sweep = swept
    db, exit_file = (sweep / "study.db").read_bytes(), tmp_path / "exit"
    r = torchrun(*SWEEP, "max_steps=4", f"hydra.sweep.dir={sweep}", cwd=root, env={"LOOPLIB_EXIT_FILE": str(exit_file)})
    said = [line for line in r.stderr.splitlines() if line.startswith("looplib: ")]
    assert said == [f"looplib: error: hydra.sweep.dir: sqlite:///{sweep}/study.db holds study 'looplib' of another "
                    "sweep (max_steps=3 there, max_steps=4 here); give a new directory (hydra.sweep.dir=...), or the "
                    "same command",
                    "looplib: stopped: rank 0 refused this sweep, its line says why; rank 1 stopped with it"], r.stderr
    assert r.stderr.count("exitcode  : 2") == 2 and exit_file.read_text() == "2\n"  # both ranks: torchrun's summary
    assert "gloo" not in r.stderr.lower() and "hydra_plugins" not in r.stderr  # no rank's traceback
    assert (sweep / "study.db").read_bytes() == db


def test_a_study_continued_on_one_process_is_refused_unless_allowed(swept):
    """The same sweep command without torchrun: its trials would train at global batch 4 and be judged
    against trials at 8. Refused in one line, exit 2, the study untouched; with
    hydra.sweeper.allow_geometry_change=true it goes on, and the report says where each trial ran."""
    root, sweep = swept
    db = (sweep / "study.db").read_bytes()
    r = run_cli(*SWEEP, f"hydra.sweep.dir={sweep}", cwd=root)
    assert r.returncode == 2 and r.stderr == (
        f"looplib: error: hydra.sweep.dir: study 'looplib' in sqlite:///{sweep}/study.db ran its trials on 2 processes "
        f"({TORCHRUN}), global batch 8, and this sweep would run on 1 process (python), global batch 4: its trials "
        "would be judged and pruned against trials of another global batch; run the sweep as before "
        f"({TORCHRUN} -m looplib.train ...), give a new directory (hydra.sweep.dir=...), or mix them knowingly with "
        "hydra.sweeper.allow_geometry_change=true\n")
    assert (sweep / "study.db").read_bytes() == db

    r = run_cli(*SWEEP, "hydra.sweeper.n_trials=4", "hydra.sweeper.allow_geometry_change=true",
                f"hydra.sweep.dir={sweep}", cwd=root)
    assert r.returncode == 0, r.stderr
    trials = study_of(sweep).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert trials[3].user_attrs["geometry"] == {"world_size": 1, "launcher": "python", "global_batch": 4}
    assert trials[3].user_attrs["command"].startswith("python -m looplib.train lr=")
    first = rows(sweep / "3" / "metrics.jsonl")[0]
    assert (first["world_size"], first["global_batch"]) == (1, 4)
    r = run_cli(str(sweep), "--out", str(root / "mixed"), module="looplib.report", cwd=root)
    assert r.returncode == 0, r.stderr
    md = (root / "mixed" / "report.md").read_text()
    assert "| job | lr | processes | global batch |" in md and "| 3 | " in md
    assert f"| 2 processes ({TORCHRUN}), global batch 8 |" in md and "| 1 process (python), global batch 4 |" in md
