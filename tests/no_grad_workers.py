"""Ranks for tests/dist/test_fsdp_no_grad_forward.py: a forward without gradients before the first
training step under FSDP2, by each path looplib runs one, then the same two steps as without it."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

import dist_workers as W
from conftest import random_tokens, tiny_gpt
from looplib.data import Epochs, held_out
from looplib.loss import TokenCrossEntropy
from looplib.optim import AdamW
from looplib.precision import FP32
from looplib.schedule import WarmupCosine

STEPS = 2


def evaluation(model, engine, precision, objective=None):
    """looplib.evaluation.evaluate (inference mode, eval mode): as an evaluation before step 1."""
    from looplib.evaluation import evaluate
    batches = held_out(W.Masked(random_tokens(21, seed=3)), 15, batch_size=4, rank=engine.rank, world=engine.world_size)
    return evaluate(model, batches, objective or TokenCrossEntropy(), precision, engine)


def chunked_evaluation(model, engine, precision):
    """The same with loss=lm_chunked, which reads the head's weight after the forward (then resharded):
    the same held-out loss as loss=lm's."""
    from looplib.loss import ChunkedTokenCrossEntropy
    chunked = evaluation(model, engine, precision, ChunkedTokenCrossEntropy(chunk_size=7))
    plain = evaluation(model, engine, precision)
    assert abs(chunked - plain) <= 1e-5 * abs(plain), (chunked, plain)


def rollouts(model, engine, precision):
    """loss=grpo's sampling (looplib.grpo.Rollouts.completions: eval mode, no gradients), each rank its prompts."""
    from looplib.grpo import Rollouts
    objective = SimpleNamespace(group_size=2, max_new_tokens=3, temperature=1.0, top_p=1.0, sampled=[0, 0.0])
    out = Rollouts([], objective, lambda: model, None, SimpleNamespace(), engine, precision, seed=0)
    prompts = random_tokens(2, seq_len=5, seed=engine.rank)
    out.completions({"prompt_ids": [prompts[i]["input_ids"] for i in range(2)], "index": torch.tensor([0, 1])})


def no_grad(model, engine, precision):
    """A plain forward under torch.no_grad, in eval mode (as DPO's reference pass runs the model)."""
    model.eval()
    with torch.no_grad():
        model(random_tokens(2, seed=engine.rank)[0]["input_ids"][None])
    model.train()


PASSES = {"none": None, "evaluation": evaluation, "chunked_evaluation": chunked_evaluation, "rollouts": rollouts,
          "no_grad": no_grad}


def trained(engine_kwargs: dict, before) -> dict:
    """A pass (or none), then the optimizer is built and two steps are trained; the gathered weights."""
    from looplib.engines.fsdp import FSDP
    engine = FSDP("cpu", **engine_kwargs)
    precision = engine.precision_for(FP32())
    engine.check(W.settings(engine.world_size), precision, None)
    model = engine.setup(tiny_gpt())
    if before is not None:
        before(model, engine, precision)
    optimizer = AdamW(lr=W.LR, weight_decay=0.1).build(model)
    scheduler = WarmupCosine(1, 0.1).build(optimizer, STEPS)
    p = engine.prepare(model, optimizer, W.settings(engine.world_size, STEPS))
    W.train(engine, p.model, p.optimizer, scheduler, precision, p.max_grad_norm,
            Epochs(W.loader(engine.rank, engine.world_size)), STEPS)
    return engine.full_weights(p.model), engine


def worker(rank: int, world: int, port: int, out: str) -> None:
    W.set_env(rank, world, port)
    got, engine = {}, None
    for reshard in (True, False):
        for name, before in PASSES.items():
            got[f"{name}/{reshard}"], engine = trained({"reshard_after_forward": reshard}, before)
    if rank == 0:
        torch.save(got, Path(out) / "no_grad.pt")
    engine.close()
