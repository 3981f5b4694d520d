"""+evaluation=bf16/fp16: held-out loss with half-precision weights; the fp32 weights come back bit for bit."""
import copy

import pytest
import torch

from looplib import ConfigError, Engine, Evaluation, HalfWeights, TokenCrossEntropy
from looplib.evaluation import evaluate
from looplib.precision import Precision

from conftest import random_tokens, tiny_gpt


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_weight_eval_equals_a_half_copy_and_restores_the_weights(dtype, torch_dtype):
    model = tiny_gpt()
    model.register_buffer("scale", torch.ones(3))  # buffers are cast too
    before = copy.deepcopy(model.state_dict())
    batches = list(torch.utils.data.DataLoader(random_tokens(n=8), batch_size=4))
    engine, objective = Engine("cpu"), TokenCrossEntropy()
    half_loss = HalfWeights(dtype)(model, batches, objective, Precision(), engine)
    reference = evaluate(copy.deepcopy(model).to(torch_dtype), batches, objective, Precision(), engine)
    assert half_loss == reference
    full = Evaluation()(model, batches, objective, Precision(), engine)
    assert half_loss != full and half_loss == pytest.approx(full, rel=2e-2)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert model.head.weight is model.tok_emb.weight  # tied weights stay tied


def test_a_non_half_dtype_is_refused():
    with pytest.raises(ConfigError) as err:
        HalfWeights("float64")
    assert err.value.key == "evaluation.dtype"
