"""+compile=default: torch.compile of the model, through the loop, with accumulation. One test
(compiling costs tens of seconds on a CPU); the YAML files themselves are built by test_config."""
import hydra
import pytest
import torch
from omegaconf import OmegaConf

from looplib import SGD, Accumulation, ConfigError, TorchCompile, fit
from looplib.evaluation import evaluate
from looplib.precision import Precision
from looplib.engines import Engine
from looplib.loss import TokenCrossEntropy

from conftest import REPO, random_tokens, tiny_gpt


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one_with_accumulation():
    strategy = hydra.utils.instantiate(OmegaConf.load(REPO / "conf" / "compile" / "default.yaml"))
    assert isinstance(strategy, TorchCompile) and strategy.mode == "default"
    data = torch.utils.data.DataLoader(random_tokens(n=8), batch_size=2)
    eval_batches = [next(iter(data))]
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model = tiny_gpt()
        keys = list(model.state_dict())
        if compiled:
            model = strategy.wrap(model)
            assert type(model).__name__ == "GPT" and list(model.state_dict()) == keys  # compiled in place
        opt = SGD(lr=0.5).build(model)  # linear in the gradient: differences stay at rounding level
        fit(model, data, objective=TokenCrossEntropy(), optimizer=opt, accumulation=Accumulation(2), max_steps=2)
        loss = evaluate(model, eval_batches, TokenCrossEntropy(), Precision(), Engine("cpu"))
        runs.append((torch.cat([p.detach().flatten() for p in model.parameters()]), loss))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames >= 1, "nothing was compiled"
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-4, atol=1e-5)
    assert runs[1][1] == pytest.approx(runs[0][1], rel=1e-4)
    assert not torch.equal(runs[0][0], torch.cat([p.detach().flatten() for p in tiny_gpt().parameters()]))


@pytest.mark.parametrize("kwargs,key", [({"mode": "fastest"}, "compile.mode"), ({"backend": "nope"}, "compile.backend")])
def test_bad_compile_settings_are_refused_at_build_time(kwargs, key):
    with pytest.raises(ConfigError) as err:
        TorchCompile(**kwargs)
    assert err.value.key == key
