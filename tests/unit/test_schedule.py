"""The schedules' factors, step by step, against their formulas written out."""
import math

import pytest
import torch

from looplib.errors import ConfigError
from looplib.schedule import WSD, Linear


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
