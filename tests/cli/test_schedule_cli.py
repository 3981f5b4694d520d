"""A run spent in warm-up, refused from the command line (the rule itself: tests/unit/test_schedule.py)."""
import pytest

from conftest import run_cli


@pytest.mark.parametrize("args", [["+schedule=cosine", "max_steps=10"],
                                  ["+schedule=linear", "schedule.warmup_steps=50", "max_steps=40"]])
def test_the_command_line_refuses_a_run_spent_in_warm_up(tmp_path, args):
    r = run_cli("data=random", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("looplib: error: schedule.warmup_steps: the warm-up") and \
        "lower schedule.warmup_steps below max_steps" in line
    assert not (tmp_path / "run").exists()


def test_a_grid_sweep_with_one_job_spent_in_warm_up_is_refused_before_any_job_runs(tmp_path):
    r = run_cli("-m", "max_steps=30,10", "+schedule=cosine", "data=random", "model.n_layer=1", "model.d_model=32",
                "model.n_head=2", "model.seq_len=16", "batch_size=2", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("looplib: error: schedule.warmup_steps: the warm-up (25 steps)")
    assert "(in job 1 of the 2: max_steps=10" in line and line.endswith("no job of the sweep has run")
    assert not (tmp_path / "sweep").exists()
