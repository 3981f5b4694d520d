"""The precision the loop sees under DeepSpeed, in-process with a stand-in for the ``DeepSpeedEngine``:
it holds no looplib engine, keeps the chosen precision's verbs until ``attach`` hands it DeepSpeed's
engine, then calls that engine's verbs (the runs themselves: tests/dist/test_engines_deepspeed.py)."""
import pytest
import torch

from looplib.errors import ConfigError
from looplib.precision import BF16, FP16, FP32
from looplib.engines.deepspeed.optim import StepHooks
from looplib.engines.deepspeed.precision import DeepSpeedPrecision


class FakeDeepSpeedEngine:
    """What the adapter may call of a ``DeepSpeedEngine``, recorded."""

    def __init__(self, applied: bool):
        self.applied, self.calls = applied, []

    def backward(self, loss, scale_wrt_gas=True):
        self.calls.append(("backward", scale_wrt_gas))

    def step(self):
        self.calls.append(("step",))

    def was_step_applied(self):
        return self.applied


def test_before_attach_every_verb_is_the_chosen_precisions():
    """``batch_size=auto`` probes the plain model before DeepSpeed exists: the chosen precision trains it."""
    chosen = FP16(init_scale=2.0**10)
    chosen.setup(torch.device("cpu"))
    precision = DeepSpeedPrecision(chosen)
    assert precision.ds is None and precision.dtype == torch.float16 and precision.scaler_args == chosen.scaler_args
    assert precision.state_dict() == chosen.state_dict() != {}  # the chosen scaler's state
    weight = torch.nn.Parameter(torch.ones(2))
    precision.backward((weight * 3).sum())
    assert torch.equal(weight.grad, torch.full((2,), 3.0 * 2**10))  # the chosen one's scaled backward ran


@pytest.mark.parametrize("applied", [True, False])
def test_attach_hands_over_to_the_deepspeed_engine_it_is_given(applied):
    """After ``attach(ds, steps)`` the verbs are DeepSpeed's: backward without dividing by the window
    again, step by DeepSpeed, the step hooks only where DeepSpeed applied the update (an fp16 overflow
    skips it), no autocast, no scaler state of looplib's."""
    chosen = BF16()
    chosen.setup(torch.device("cpu"))
    precision = DeepSpeedPrecision(chosen)
    ds, model = FakeDeepSpeedEngine(applied), torch.nn.Linear(2, 2)
    steps, fired = StepHooks(torch.optim.SGD(model.parameters(), lr=0.1)), []
    steps.register_step_post_hook(lambda *args: fired.append(args))
    precision.attach(ds, steps)

    assert precision.autocast().__class__.__name__ == "nullcontext"
    precision.backward(torch.ones(()))
    precision.unscale(steps)
    assert precision.step(steps) is None
    assert ds.calls == [("backward", False), ("step",)]
    assert len(fired) == (1 if applied else 0)
    assert precision.state_dict() == {}


def test_a_users_precision_that_deepspeed_would_bypass_is_refused_at_construction():
    class OwnAutocast(FP32):
        __module__ = "my_research.precisions"

        def autocast(self):
            raise AssertionError("never called under DeepSpeed")

    with pytest.raises(ConfigError) as err:
        DeepSpeedPrecision(OwnAutocast())
    assert err.value.key == "precision._target_"
    assert "my_research.precisions" in str(err.value) and "overrides autocast" in str(err.value)
