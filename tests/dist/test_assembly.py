"""One assembly: the command line's path (``looplib.cli.main.job_spec`` run by a ``looplib.run.session.Session``,
what ``python -m looplib.train`` runs after Hydra composes) and ``train_model`` build and run the same job, for every engine; and
``train_model`` has the CLI's run directory, checkpoints, resume and signal handling."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, random_tokens, tiny_gpt
import warm_ranks
from looplib import AdamW, ConfigError, Interrupted, RandomCorpus, train_model
from looplib.loggers import Logger

sys.path.insert(0, str(REPO / "tests"))
import assembly_worker  # noqa: E402
from signal_at import SignalAt  # noqa: E402

COMPARED = ("step", "epoch", "loss", "lr", "grad_norm", "eval_loss", "skipped_steps")


def rows(run_dir):
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        kept = {k: row[k] for k in COMPARED if k in row}
        if len(kept) > 1:
            out.append(kept)
    return out


def same_run(cli, api, ranks=(0,)):
    assert rows(cli) and rows(cli) == rows(api)
    a, b = load_file(cli / "model.safetensors"), load_file(api / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if (cli / "checkpoints").exists():
        steps = sorted(p.name for p in (cli / "checkpoints").iterdir())
        assert steps == sorted(p.name for p in (api / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    for rank in ranks:  # every rank ends with the weights rank 0 exported
        own = torch.load(api / f"rank{rank}.pt")
        assert all(torch.equal(own[k], b[k]) for k in b), f"rank {rank} differs"


def test_local_engine_cli_path_equals_train_model(tmp_path):
    assembly_worker.main(tmp_path, ["local"])
    same_run(tmp_path / "local" / "cli", tmp_path / "local" / "api")
    from looplib.store.checkpoint_dir import read_config
    saved, cli = (read_config(tmp_path / "local" / way / "config.yaml") for way in ("api", "cli"))
    assert saved["max_steps"] == cli["max_steps"] == 4
    assert saved["optim"]["_target_"] == cli["optim"]["_target_"] == "looplib.optim.AdamW"
    assert saved["engine"] == {"_target_": "looplib.engines.Engine"}  # nothing per process: no rank, no device


@pytest.mark.slow
def test_distributed_engines_cli_path_equals_train_model(tmp_path):
    """DDP, FSDP2 and DeepSpeed ZeRO-2 on 2 CPU processes, one torchrun launch: the two ways in
    agree bit for bit, and every rank holds the same weights (train_model once trained two
    unsynchronised DeepSpeed replicas: engine.prepare was never called)."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests"), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(REPO / "tests" / "assembly_worker.py"), str(tmp_path), "ddp", "fsdp", "deepspeed"]),
                       env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for engine in ("ddp", "fsdp", "deepspeed"):
        same_run(tmp_path / engine / "cli", tmp_path / engine / "api", ranks=(0, 1))


def test_train_model_under_torchrun_without_an_engine_trains_ddp_as_the_command_line_does(tmp_path):
    """The launcher rules (looplib.run.launcher) for both ways in: no engine under torchrun is DDP,
    one run (one set of checkpoints, every rank ending with the same weights), bit for bit the
    command line's run; not one copy of the job per rank writing the same files."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests"), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(warm_ranks.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(REPO / "tests" / "assembly_worker.py"), str(tmp_path), "none"]),
                       env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cli, api = tmp_path / "none" / "cli", tmp_path / "none" / "api"
    same_run(cli, api, ranks=(0, 1))  # checkpoints step-2 and step-4 only, in each
    from looplib.store.checkpoint_dir import read_config
    assert read_config(api / "config.yaml")["engine"]["_target_"] == "looplib.engines.DDP"  # the package export, as conf/ names it
    assert read_config(cli / "config.yaml")["engine"]["_target_"] == "looplib.engines.DDP"  # (said: test_launch_default)


def job(**kwargs):
    torch.manual_seed(0)
    return dict(model=tiny_gpt(), dataset=RandomCorpus(seq_len=16, vocab_size=64, n_train=48, n_eval=8),
                max_steps=6, batch_size=4, accum_steps=2, optim=AdamW(lr=1e-2), eval_every=3, eval_samples=4,
                log_every=1, device="cpu", progress="lines", **kwargs)


def test_train_model_sigterm_then_resume_equals_an_uninterrupted_run(tmp_path):
    whole = train_model(**job(), run_dir=tmp_path / "whole")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stop:
        train_model(**job(logger=SignalAt(4)), run_dir=tmp_path / "cut")
    assert stop.value.status == 75 and stop.value.result.state.step == 4
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back
    assert (tmp_path / "cut" / "checkpoints" / "step-00000004" / "manifest.json").exists()
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # stopped, not finished
    with pytest.raises(ConfigError, match="run_dir: .* already holds files"):
        train_model(**job(), run_dir=tmp_path / "cut")  # never mixed into another run without resume
    resumed = train_model(**job(), run_dir=tmp_path / "cut", resume="auto")
    assert resumed.state.step == 6
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rows(tmp_path / "whole") == [r for r in rows(tmp_path / "cut") if "resumed_from" not in r]
    assert resumed.run_dir == tmp_path / "cut" and resumed.eval_loss == whole.eval_loss


def test_train_model_refuses_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^max_steps: "):
        train_model(tiny_gpt(), random_tokens(8), max_steps=0, device="cpu")
    with pytest.raises(ConfigError, match="^resume: .* needs the run directory"):
        train_model(tiny_gpt(), random_tokens(8), max_steps=1, resume="auto", device="cpu")
    with pytest.raises(ConfigError, match="^export: "):
        train_model(tiny_gpt(), random_tokens(8), max_steps=1, export="hf", run_dir=tmp_path / "r", device="cpu")
    with pytest.raises(ConfigError, match=r"^export: export='onnx' is not a kind of export"):
        train_model(tiny_gpt(), random_tokens(8), max_steps=1, export="onnx", run_dir=tmp_path / "r", device="cpu")
    # the command line's option names where the objects go: the class to pass is named
    for group, option, said in (("precision", "bf16", "precision=BF16() (from looplib.precision import BF16)"),
                                ("engine", "ddp", "engine=DDP() (from looplib.engines import DDP)"),
                                ("optim", "adam8bit", "optim=Adam8bit() (from looplib.optim import Adam8bit)")):
        with pytest.raises(ConfigError, match=f"^{group}: {group}='{option}' is the command line's option name") as e:
            train_model(tiny_gpt(), random_tokens(8), max_steps=1, run_dir=tmp_path / "r", device="cpu",
                        **{group: option})
        assert said in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"^schedule: schedule=dict\(...\) is not a Schedule"):
        train_model(tiny_gpt(), random_tokens(8), max_steps=1, schedule={"warmup_steps": 2}, device="cpu")
    assert not (tmp_path / "r").exists()


def test_a_preempted_runs_newest_checkpoint_is_what_generate_and_load_finished_take(tmp_path, capsys):
    """looplib.store.finished: a run stopped before its end has no exported weights; ``python -m
    looplib.generate`` and the Python API load its newest checkpoint and say which, and take that
    checkpoint's directory itself too."""
    from conftest import run_cli
    from looplib import load_finished
    from looplib.cli.generate import main
    from looplib.models import GPT
    run = tmp_path / "cut"
    r = run_cli("data=random", "data.vocab_size=64", "data.n_train=64", "model.n_layer=1", "model.d_model=32",
                "model.n_head=2", "model.seq_len=16", "batch_size=4", "log_every=1", "checkpoint.every_steps=2",
                "max_steps=8", "+logger.stop._target_=signal_at.SignalAt", "+logger.stop.step=4",
                f"hydra.run.dir={run}", cwd=tmp_path, env={"PYTHONPATH": str(REPO / "tests")})
    assert r.returncode == 75, r.stderr[-2000:]
    newest = run / "checkpoints" / "step-00000004"
    assert not (run / "model.safetensors").exists() and newest.is_dir()
    done = load_finished(run, "cpu")
    assert done.checkpoint == newest and done.run_dir == run and isinstance(done.model, GPT)
    saved = load_file(newest / "model.safetensors")
    assert all(torch.equal(v, done.model.state_dict()[k]) for k, v in saved.items())  # (tied weights: once)
    assert main([str(run), "--prompt", "ab", "--tokens", "3"]) == 0
    out = capsys.readouterr()
    assert f"looplib: {run} was stopped before its end: sampling from its newest checkpoint, {newest}" in out.err
    assert out.out.strip()
    assert main([str(newest), "--prompt", "ab", "--tokens", "3"]) == 0  # the checkpoint itself, accepted
    assert "stopped before its end" not in capsys.readouterr().err


def test_load_finished_takes_a_python_runs_model_object(tmp_path):
    """A train_model run's config.yaml names only its model's class: load_finished refuses to guess
    its arguments, and loads the weights into the model it is given."""
    from looplib import load_finished
    train_model(**job(), run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="names the model's class but not its arguments"):
        load_finished(tmp_path / "run", "cpu")
    done = load_finished(tmp_path / "run", "cpu", model=tiny_gpt(seed=5))
    saved = load_file(tmp_path / "run" / "model.safetensors")
    assert done.checkpoint is None and all(torch.equal(v, done.model.state_dict()[k]) for k, v in saved.items())
