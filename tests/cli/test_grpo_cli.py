"""``loss=grpo`` from the command line (issue 41): a run end to end, resumed bit for bit (sampling
included), a reward that breaks its contract, and the refusals between data, loss and reward."""
from __future__ import annotations

import json
import random

import pytest

from conftest import run_cli

SMALL = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=24", "data.vocab_size=300",
         "batch_size=2", "log_every=1", "sample_tokens=0", "loss.group_size=2", "loss.max_new_tokens=4"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # bit for bit on the CPU: one thread's order of sums


def write_sums(tmp_path, n=24):
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "note": {"kept": [a, b]}})
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_runs_end_to_end_logs_rewards_and_resumes_bit_for_bit(tmp_path):
    # an untrained model's completions are a few bytes: a lowercase letter in them is the reward that varies
    job = ["data=prompts", f"data.path={write_sums(tmp_path)}", "loss=grpo", "+reward=exact_and_format", *SMALL,
           "reward.rewards.format.pattern='[a-z]'", "checkpoint.every_steps=2"]
    r = run_cli(*job, "max_steps=4", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    steps = [x for x in rows(tmp_path / "full") if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4] and sum(x["grad_norm"] > 0 for x in steps) >= 2  # real updates
    for x in steps:
        assert {"reward", "reward_std", "completion_tokens", "clipped", "kl", "entropy", "tokens_per_s",
                "rollout_tokens_per_s"} <= set(x)
        assert 0.0 <= x["reward"] <= 1.1 and 1.0 <= x["completion_tokens"] <= 4.0 and x["rollout_tokens_per_s"] > 0
        parts = x["reward_exact_answer"], x["reward_format"]  # each of the weighted rewards, unweighted
        assert x["reward"] == pytest.approx(parts[0] + 0.1 * parts[1]) and 0 <= parts[1] <= 1
    part = tmp_path / "part"
    assert run_cli(*job, "max_steps=2", f"hydra.run.dir={part}", cwd=tmp_path, env=ONE_THREAD).returncode == 0
    r = run_cli(*job, "max_steps=4", "resume=auto", f"hydra.run.dir={part}", cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert (part / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()
    resumed = {x["step"]: x for x in rows(part) if "loss" in x}
    for x in steps[2:]:  # the same completions sampled after the resume: the same rewards and lengths
        assert (resumed[x["step"]]["reward"], resumed[x["step"]]["completion_tokens"]) == \
            (x["reward"], x["completion_tokens"])


def test_two_updates_per_rollout_resume_bit_for_bit_from_between_a_rollouts_updates(tmp_path):
    """loss.updates_per_rollout=2: a run stopped after step 3 (the first update of the second rollout)
    holds that rollout in its checkpoint, and resumes to the uninterrupted run's weights bit for bit."""
    job = ["data=prompts", f"data.path={write_sums(tmp_path)}", "loss=grpo", "+reward=format",
           "reward.pattern='[a-z]'", *SMALL, "loss.updates_per_rollout=2", "checkpoint.every_steps=1"]
    r = run_cli(*job, "max_steps=5", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    part = tmp_path / "part"
    assert run_cli(*job, "max_steps=3", f"hydra.run.dir={part}", cwd=tmp_path, env=ONE_THREAD).returncode == 0
    r = run_cli(*job, "max_steps=5", "resume=auto", f"hydra.run.dir={part}", cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert (part / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()
    full = [x for x in rows(tmp_path / "full") if "loss" in x]
    assert sum(x["grad_norm"] > 0 for x in full) >= 2
    assert full[0]["reward"] == full[1]["reward"]  # both updates of one rollout: its rewards


REWARDS = '''
calls = 0


def third_call_fails(prompts, completions, records):
    global calls
    calls += 1
    if calls == 3:
        raise KeyError("expected")
    return [float(c.strip() == r["answer"]) for c, r in zip(completions, records)]
'''


def test_a_reward_that_raises_stops_the_run_in_one_line_and_the_last_checkpoint_stays(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    r = run_cli("data=prompts", f"data.path={write_sums(tmp_path)}", "loss=grpo",
                "+reward._target_=my_rewards.third_call_fails", *SMALL, "checkpoint.every_steps=1", "max_steps=4",
                f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, fresh=True)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "third_call_fails" in line and "raised KeyError" in line and "prompt '" in line and "+" in line
    assert "Traceback" not in r.stderr
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved[-1] == "step-00000002", saved  # steps 1 and 2 trained and saved; nothing of step 3
    steps = [x["step"] for x in rows(tmp_path / "run") if "loss" in x]
    assert steps == [1, 2]


def test_prompts_loss_and_reward_are_refused_apart(tmp_path):
    data = write_sums(tmp_path)
    r = run_cli("data=prompts", f"data.path={data}", "loss=grpo", "+reward=exact_answer", *SMALL, "max_steps=2",
                f"hydra.run.dir={tmp_path / 'ok'}", cwd=tmp_path)  # the command as typed works; the others are refused
    assert r.returncode == 0 and (tmp_path / "ok" / "model.safetensors").exists(), r.stderr
    r = run_cli("data=prompts", f"data.path={data}", "loss=grpo", *SMALL, f"hydra.run.dir={tmp_path / 'a'}",
                cwd=tmp_path)
    assert r.returncode == 2 and "+reward=exact_answer" in r.stderr.strip().splitlines()[-1], r.stderr
    r = run_cli("data=prompts", f"data.path={data}", "+reward=exact_answer", *SMALL[:-2],
                f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    assert r.returncode == 2 and "loss=grpo" in r.stderr.strip().splitlines()[-1], r.stderr
    r = run_cli("data=prompts", f"data.path={data}", "loss=grpo", "+reward=exact_answer", *SMALL,
                "loss.max_new_tokens=40", f"hydra.run.dir={tmp_path / 'c'}", cwd=tmp_path)
    assert r.returncode == 2 and "loss.max_new_tokens" in r.stderr.strip().splitlines()[-1], r.stderr
    for d in "abc":
        assert not (tmp_path / d / "metrics.jsonl").exists()
