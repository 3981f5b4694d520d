"""Hydra and several processes: one run directory per run, and sweeps sent through Hydra's
submitit launcher (composed for SLURM, run for real with its local executor)."""
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from conftest import run_cli
from looplib.cli.resolvers import rank0_dir

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def test_rank0_keeps_the_run_dir_other_ranks_get_scratch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert rank0_dir("outputs/x") == "outputs/x"
    monkeypatch.setenv("RANK", "1")
    scratch = Path(rank0_dir("outputs/x"))
    assert scratch.name.startswith("looplib-rank1-") and scratch.is_dir() and "outputs" not in str(scratch)
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert rank0_dir("outputs/x") == "outputs/x"


def test_slurm_launcher_config_composes():
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "+engine=ddp"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8   # one rank per GPU
    assert cfg.engine._target_ == "looplib.engines.DDP"


def test_sweep_through_the_submitit_launcher(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/launcher=submitit_local", "+engine=ddp", "data=random", "max_steps=2", "batch_size=2",
                "log_every=1", "eval_samples=4", "sample_tokens=0", "model.n_layer=1", "model.d_model=32",
                "model.n_head=2", "model.seq_len=16", "lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    for job, lr in (("0", 1e-3), ("1", 2e-3)):
        rows = [json.loads(x) for x in (sweep / job / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in rows if "loss" in m] == [1, 2] and rows[0]["lr"] == pytest.approx(lr)
        assert (sweep / job / "model.safetensors").exists()
