"""fp16 loss scaling, bf16 without a scaler, and refusing a device that cannot autocast."""
import pytest
import torch

from looplib import optim as lo
from looplib import precision as prec
from looplib.accumulation import Accumulation
from looplib.data import build_loader
from looplib.errors import ConfigError
from looplib.loop import fit
from looplib.objectives import TokenCrossEntropy
from looplib.telemetry import Telemetry

from conftest import random_tokens, tiny_gpt


class PoisonOnce(TokenCrossEntropy):
    """Multiplies one chosen micro-batch's loss by inf."""

    def __init__(self, poison_call: int):
        super().__init__()
        self.calls, self.poison_call = 0, poison_call

    def __call__(self, model, batch):
        loss = super().__call__(model, batch)
        self.calls += 1
        return loss * float("inf") if self.calls == self.poison_call else loss


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def test_fp16_inf_skips_exactly_that_update_and_lowers_the_scale():
    accum = 2
    loader = build_loader(random_tokens(n=24), batch_size=4, seed=0)
    model = tiny_gpt()
    opt = lo.AdamW(lr=1e-2, impl="for-loop").build(model)
    fp16 = prec.FP16(init_scale=1024.0)
    fp16.setup("cpu")
    telemetry = Telemetry(enabled=False)
    objective = PoisonOnce(poison_call=4)  # second micro-batch of step 2
    before = {}
    unscale_calls = []
    real_unscale = fp16.scaler.unscale_
    fp16.scaler.unscale_ = lambda o: (unscale_calls.append(1), real_unscale(o))[1]

    # run step by step so the weights around the poisoned step can be compared
    from looplib.data import Epochs
    from looplib.loop import TrainState
    epochs, state = Epochs(loader), TrainState()
    for step in range(1, 4):
        before[step] = snapshot(model)
        scale = fp16.scaler.get_scale()
        fit(model, epochs, objective=objective, optimizer=opt, max_steps=step, precision=fp16,
            accumulation=Accumulation(accum), telemetry=telemetry, state=state)
        after = snapshot(model)
        unchanged = all(torch.equal(a, b) for a, b in zip(before[step], after))
        if step == 2:
            assert unchanged, "the overflowing step must leave the weights untouched"
            assert fp16.scaler.get_scale() == scale * 0.5
        else:
            assert not unchanged
            assert fp16.scaler.get_scale() == scale
    assert len(unscale_calls) == 3  # once per optimizer step, never per micro-batch
    assert telemetry.boundaries == 3 and telemetry.optimizer_steps == 2


def test_fp16_scaler_state_round_trips():
    a, b = prec.FP16(init_scale=8.0), prec.FP16()
    a.setup("cpu"), b.setup("cpu")
    b.load_state_dict(a.state_dict())
    assert b.scaler.get_scale() == 8.0


@pytest.mark.parametrize("cls", [prec.FP32, prec.TF32, prec.BF16])
def test_no_scaler_without_fp16(cls):
    p = cls()
    p.setup("cpu")
    assert p.scaler is None and p.state_dict() == {}


def test_bf16_autocast_runs_matmuls_in_bf16():
    p = prec.BF16()
    p.setup("cpu")
    with p.autocast():
        assert (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.bfloat16


def test_device_without_autocast_is_refused():
    with pytest.raises(ConfigError, match="fp16 needs autocast, which meta does not offer"):
        prec.FP16().setup("meta")


def test_device_whose_autocast_fails_is_refused(monkeypatch):
    monkeypatch.setattr(prec, "autocast_works", lambda device, dtype: False)
    with pytest.raises(ConfigError) as err:
        prec.BF16().setup("cpu")
    assert err.value.key == "precision" and "bf16 autocast does not run on cpu" in str(err.value)
