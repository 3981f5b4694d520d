"""Muon on two processes (DDP, FSDP2) and a stopped and resumed run (the in-process tests: tests/unit/test_muon.py)."""
import pytest
import torch

import dist_workers as W
from conftest import run_cli


def test_two_processes_under_ddp_and_fsdp_equal_one_within_1e_5(tmp_path):
    """Same global batch: DDP all-reduces the gradients; FSDP2 reduce-scatters them, and each
    Muon matrix's update is gathered whole for Newton-Schulz on every rank. With Newton-Schulz in
    fp32 the weights agree within 1e-5 (measured 6.8e-6, on a bias: AdamW's 1/sqrt(v)), and DDP
    and FSDP bit for bit. torch's bf16 Newton-Schulz turns the gradients' last-bit differences
    (two ranks sum in another order) into bf16 roundings: losses agree to 2e-6 relative, the
    matrices to about 1e-3 after 4 steps (docs/command-line.md#muon)."""
    W.spawn(W.muon_worker, 2, tmp_path)
    got = torch.load(tmp_path / "muon.pt", weights_only=True)
    losses, weights = W.local_reference(W.STEPS, W.muon(ns_dtype="fp32"))
    for run in ("ddp fp32", "fsdp fp32"):
        assert len(got[run]["muon"]) == 8, run
        assert got[run]["losses"] == pytest.approx(losses, rel=1e-6), run
        for name, value in weights.items():
            torch.testing.assert_close(got[run]["weights"][name], value, atol=1e-5, rtol=0, msg=f"{run} {name}")
            assert torch.equal(got["ddp fp32"]["weights"][name], got["fsdp fp32"]["weights"][name]), name
    bf16_losses, _ = W.local_reference(W.STEPS, W.muon())
    assert got["fsdp bf16"]["losses"] == pytest.approx(bf16_losses, rel=1e-5)


MUON_JOB = ["data=random", "data.n_train=128", "model.seq_len=32", "model.n_layer=2", "model.d_model=64",
            "batch_size=4", "accum_steps=2", "max_steps=8", "log_every=1", "eval_every=0", "eval_samples=4",
            "sample_tokens=0", "progress=lines", "+optim=muon", "optim.ns_dtype=fp32", "+schedule=wsd",
            "schedule.warmup_steps=2", "schedule.decay_fraction=0.5"]


def wsd_lr(step: int, lr: float = 2e-3, warmup: int = 2, total: int = 8, decay: int = 4) -> float:
    """WSD's lr after ``step`` optimizer steps, written out: what the metrics row of that step logs."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step < total - decay:
        return lr
    return lr * (1 - (step - (total - decay)) / decay)


def test_a_muon_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """SIGTERM mid-run: a checkpoint, exit 75; resume=auto finishes bit for bit as the run that
    was never stopped, the wsd lr equal to its formula at every step on both. The uninterrupted
    run's step-4 checkpoint resumed on two processes under FSDP2 (the accumulation halves, the
    global batch stays) continues within 1e-5."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from safetensors.torch import load_file
    from test_engines_ddp import torchrun

    def rows(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    ref = tmp_path / "ref"
    r = run_cli(*MUON_JOB, "checkpoint.every_steps=4", f"hydra.run.dir={ref}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "looplib.train", *MUON_JOB, "checkpoint.every_steps=0",
                             f"hydra.run.dir={run}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and (not (run / "metrics.jsonl").exists() or len(rows(run)) < 2):
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err
    assert 2 <= int(next((run / "checkpoints").iterdir()).name.split("-")[1]) < 8
    r = run_cli(*MUON_JOB, "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    a, b = load_file(ref / "model.safetensors"), load_file(run / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for done in (ref, run):
        train = [m for m in rows(done) if "loss" in m]
        assert [m["step"] for m in train] == list(range(1, 9))
        assert [m["lr"] for m in train] == pytest.approx([wsd_lr(m["step"]) for m in train], rel=1e-12)
    assert [m["loss"] for m in rows(run) if "loss" in m] == [m["loss"] for m in rows(ref) if "loss" in m]

    two = tmp_path / "two"
    r = torchrun(*MUON_JOB, "+engine=fsdp", f"resume={ref / 'checkpoints' / 'step-00000004'}",
                 f"hydra.run.dir={two}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "accum_steps 2 -> 1, global batch 8 kept" in r.stdout
    ref_losses = {m["step"]: m["loss"] for m in rows(ref) if "loss" in m}
    assert {m["step"]: m["loss"] for m in rows(two) if "loss" in m} == pytest.approx(
        {s: ref_losses[s] for s in range(5, 9)}, rel=1e-5)
    c = load_file(two / "model.safetensors")
    for k in a:
        torch.testing.assert_close(c[k], a[k], atol=1e-5, rtol=0)
