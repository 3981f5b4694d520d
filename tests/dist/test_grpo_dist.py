"""loss=grpo under torchrun (issue 41): each rank samples its own prompts, and the window's completion
tokens are counted over both ranks, so 2 processes of 2 prompts = 1 process of 4 prompts."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from test_engines_ddp import LOSS_RTOL, WEIGHT_ATOL, torchrun
from test_grpo_cli import SMALL, write_sums


def test_grpo_on_two_processes_equals_one_process_of_twice_the_batch(tmp_path):
    from safetensors.torch import load_file

    small = [s for s in SMALL if not s.startswith("batch_size=")]
    job = ["data=prompts", f"data.path={write_sums(tmp_path)}", "loss=grpo", "+reward=format", *small,
           "reward.pattern='[a-z]'", "max_steps=3", "+optim=sgd", "optim.momentum=0", "lr=0.5"]
    two = torchrun("+engine=ddp", *job, "batch_size=2", f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    one = run_cli(*job, "batch_size=4", f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    def read(run):
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    rows = [(a, b) for a, b in zip(read("two"), read("one")) if "loss" in b]
    assert len(rows) == 3 and any(0 < b["reward"] < 1 for _, b in rows)  # rewards that differ: a real update
    for a, b in rows:
        for key in ("loss", "reward", "completion_tokens"):
            assert a[key] == pytest.approx(b[key], rel=LOSS_RTOL, abs=1e-7), key
    weights = load_file(tmp_path / "two" / "model.safetensors")
    expected = load_file(tmp_path / "one" / "model.safetensors")
    assert max((weights[k] - expected[k]).abs().max().item() for k in expected) < WEIGHT_ATOL


def test_two_updates_per_rollout_on_two_processes_resume_between_a_rollouts_updates(tmp_path):
    """loss.updates_per_rollout=2 under DDP: the checkpoint after step 3 (between the second rollout's
    updates) holds both ranks' micro-batches; the run resumed from it on two processes ends with the
    uninterrupted run's weights, and on one process it is refused in one line."""
    small = [s for s in SMALL if not s.startswith("batch_size=")]
    job = ["data=prompts", f"data.path={write_sums(tmp_path)}", "loss=grpo", "+reward=format", *small,
           "reward.pattern='[a-z]'", "batch_size=2", "loss.updates_per_rollout=2", "checkpoint.every_steps=1",
           "+engine=ddp"]
    full = torchrun(*job, "max_steps=5", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    part = tmp_path / "part"
    assert torchrun(*job, "max_steps=3", f"hydra.run.dir={part}", cwd=tmp_path).returncode == 0
    config = (part / "config.yaml").read_bytes()
    alone = run_cli(*job[:-1], "max_steps=5", "resume=auto", f"hydra.run.dir={part}", cwd=tmp_path)
    assert alone.returncode == 2 and "same number of processes" in alone.stderr.strip().splitlines()[-1], alone.stderr
    assert "Traceback" not in alone.stderr and (part / "config.yaml").read_bytes() == config  # refused before writing
    r = torchrun(*job, "max_steps=5", "resume=auto", f"hydra.run.dir={part}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (part / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()
