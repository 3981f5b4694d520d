"""The schedules' factors, step by step, against their formulas written out."""
import math

import pytest
import torch

from looplib.errors import ConfigError
from looplib.schedule import WSD, Linear, WarmupCosine


@pytest.mark.parametrize("shape, cool", [("linear", lambda p: 1 - p), ("cosine", lambda p: (1 + math.cos(math.pi * p)) / 2),
                                         ("1-sqrt", lambda p: 1 - math.sqrt(p))])
def test_wsd_equals_its_formula_at_every_step(shape, cool):
    total, warm, floor = 40, 5, 0.1
    decay = round(0.25 * total)
    schedule = WSD(warmup_steps=warm, decay_fraction=0.25, decay_shape=shape, min_ratio=floor)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = schedule.build(opt, total)
    for s in range(total):
        want = (s + 1) / warm if s < warm else 1.0 if s < total - decay else \
            floor + (1 - floor) * cool((s - (total - decay)) / decay)
        assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * want, rel=1e-12), s
        opt.step()
        sched.step()


def test_linear_equals_its_formula_and_wsd_refuses_an_overlap():
    schedule = Linear(warmup_steps=4, min_ratio=0.0)
    assert [schedule.factor(s, 12) for s in range(12)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0] + [1 - (s - 4) / 8 for s in range(4, 12)])
    with pytest.raises(ConfigError) as err:
        WSD(warmup_steps=30, decay_fraction=0.5).build(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), 50)
    assert err.value.key == "schedule.warmup_steps" and "overlap" in str(err.value)
    assert WSD(decay_fraction=0.0).factor(99, 100) == 1.0  # no cool-down: flat to the end


def test_the_docs_picture_is_drawn_from_the_classes(tmp_path):
    pytest.importorskip("matplotlib")
    import importlib.util
    from conftest import REPO
    spec = importlib.util.spec_from_file_location("plot_schedules", REPO / "scripts" / "plot_schedules.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert {type(s).__name__ for s in plot.shapes().values()} == {"Schedule", "WarmupCosine", "Linear", "WSD"}
    assert plot.plot(tmp_path / "s.png", 50).read_bytes()[:4] == b"\x89PNG"
    assert "![the schedules' shapes](schedules.png)" in (REPO / "docs" / "command-line.md").read_text()
    assert (REPO / "docs" / "schedules.png").exists()


@pytest.mark.parametrize("schedule", [WarmupCosine(), Linear(), WSD(decay_fraction=0.0), WarmupCosine(warmup_steps=10)])
def test_a_warm_up_as_long_as_the_run_is_refused_by_every_schedule_with_one(schedule):
    with pytest.raises(ConfigError) as err:
        schedule.check(10)
    assert err.value.key == "schedule.warmup_steps" and "whole run would be spent in warm-up" in str(err.value)
    with pytest.raises(ConfigError):  # building it directly meets the same rule
        schedule.build(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), 10)
    schedule.check(schedule.warmup_steps + 1)  # one step past the warm-up: accepted


def test_a_resume_to_fewer_steps_than_the_warm_up_is_refused(tmp_path):
    from looplib import train_model
    from conftest import random_tokens, tiny_gpt
    data = random_tokens(n=16)
    train_model(tiny_gpt(), data, max_steps=8, batch_size=4, schedule=WarmupCosine(warmup_steps=5), device="cpu",
                run_dir=tmp_path / "a", checkpoint_every=2, keep=10, sample_tokens=0)
    with pytest.raises(ConfigError, match="schedule.warmup_steps: the warm-up .5 steps.*max_steps=4"):
        train_model(tiny_gpt(), data, max_steps=4, batch_size=4, schedule=WarmupCosine(warmup_steps=5), device="cpu",
                    run_dir=tmp_path / "b", resume=tmp_path / "a" / "checkpoints" / "step-00000002")
    assert not (tmp_path / "b").exists()


def test_a_resume_that_moves_the_schedule_says_what_the_lr_does(tmp_path, caplog):
    """A run resumed inside its WSD cool-down with more max_steps goes back to the full lr; the
    resume said only "max_steps: 12 -> 24" (issue 43). It now says where the lr goes, by how much,
    and that it leaves the cool-down; the rate the optimizer then uses is the one said."""
    import logging
    from looplib import train_model
    from conftest import random_tokens, tiny_gpt
    data = random_tokens(n=64)
    wsd = WSD(warmup_steps=2, decay_fraction=0.5)
    train_model(tiny_gpt(), data, max_steps=12, batch_size=4, schedule=wsd, device="cpu",
                run_dir=tmp_path / "a", checkpoint_every=10, keep=10, sample_tokens=0, eval_every=0)
    assert wsd.factor(10, 12) < 1.0 == wsd.factor(10, 24)  # step 10: in the cool-down of 12, stable in 24
    with caplog.at_level(logging.WARNING, logger="looplib"):
        result = train_model(tiny_gpt(), data, max_steps=24, batch_size=4, schedule=wsd, device="cpu",
                             run_dir=tmp_path / "b", resume=tmp_path / "a" / "checkpoints" / "step-00000010",
                             sample_tokens=0, eval_every=0)
    said = [r.getMessage() for r in caplog.records if "recomputes" in r.getMessage()]
    assert len(said) == 1 and "max_steps 12 -> 24" in said[0] and "at step 10 the lr rises from" in said[0]
    assert f"{wsd.factor(10, 12):.4g} x lr to 1 x lr (back out of its cool-down)" in said[0]
    assert result.state.step == 24
    assert WarmupCosine(warmup_steps=2).moved(10, 12, 12) is None  # max_steps kept: nothing to say
