"""The loop without Hydra: ``train_model`` does what ``python -m looplib.train`` does, in Python.

    from looplib import BF16, AdamW, train_model
    result = train_model(MyModel(), my_dataset, max_steps=1000, batch_size=8, accum_steps=4,
                         precision=BF16(), optim=AdamW(lr=3e-4, weight_decay=0.1))

Every argument is the same strategy object a config group builds (``conf/<group>/*.yaml``
names its class and arguments); an argument left out is that group's plain-PyTorch default.
Nothing here imports Hydra or OmegaConf.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from .accumulation import Accumulation
from .adapters import FullModel
from .compile import Compile
from .data import Epochs, build_loader
from .engines import Engine
from .evaluation import Evaluation
from .loop import TrainState, fit
from .objectives import TokenCrossEntropy
from .optim import AdamW, OptimizerFactory, Schedule
from .precision import Precision
from .telemetry import Telemetry


@dataclass
class Trained:
    model: nn.Module                 # on the device; wrapped by peft when an adapter was chosen
    optimizer: torch.optim.Optimizer
    scheduler: object
    state: TrainState
    eval_loss: float | None          # on ``eval_dataset`` after the last step (None without one)


def train_model(model: nn.Module, dataset: Dataset, *, max_steps: int, batch_size: int = 8,
                accum_steps: int = 1, objective=None, precision: Precision | None = None,
                optim: OptimizerFactory | None = None, schedule: Schedule | None = None,
                peft: FullModel | None = None, compile: Compile | None = None,
                evaluation: Evaluation | None = None, eval_dataset: Dataset | None = None,
                eval_every: int = 0, eval_batches: int = 8, max_grad_norm: float | None = 1.0,
                device: str = "auto", seed: int = 0, metrics: str | Path | None = None,
                log_every: int = 10, engine: Engine | None = None) -> Trained:
    """Set the pieces up in the order the CLI does (device, precision, adapter, compile,
    optimizer, schedule, loaders) and run ``looplib.fit``."""
    engine = engine or Engine(device)
    precision = precision or Precision()
    precision.setup(engine.device)
    objective = objective or TokenCrossEntropy()
    evaluation = evaluation or Evaluation()
    model = (compile or Compile()).wrap(engine.setup((peft or FullModel()).wrap(model)))
    optimizer = (optim or AdamW()).build(model)  # the command line's defaults (looplib.optim.LR, ...)
    scheduler = (schedule or Schedule()).build(optimizer, max_steps)
    train = build_loader(dataset, batch_size=batch_size, seed=seed, device=engine.device,
                         rank=engine.rank, world=engine.world_size)
    held_out = None
    if eval_dataset is not None:
        loader = build_loader(eval_dataset, batch_size=batch_size, seed=seed, shuffle=False, device=engine.device)
        held_out = [b for _, b in zip(range(eval_batches), loader)]
    telemetry = Telemetry(metrics, log_every=log_every, total_steps=max_steps, device=engine.device,
                          enabled=metrics is not None and engine.is_main, progress="lines")
    try:
        state = fit(model, Epochs(train), objective=objective, optimizer=optimizer, scheduler=scheduler,
                    precision=precision, accumulation=Accumulation(accum_steps), engine=engine,
                    max_steps=max_steps, max_grad_norm=max_grad_norm, telemetry=telemetry,
                    eval_data=held_out, eval_every=eval_every, evaluator=evaluation)
        if held_out and not (eval_every and state.step % eval_every == 0):
            telemetry.eval(state.step, evaluation(model, held_out, objective, precision, engine))
    finally:
        telemetry.close()
    return Trained(model, optimizer, scheduler, state, telemetry.last_row.get("eval_loss"))
