"""The loop without Hydra: ``train_model`` does what ``python -m looplib.train`` does, in Python.

    from looplib import BF16, AdamW, train_model
    result = train_model(MyModel(), my_dataset, max_steps=1000, batch_size=8, accum_steps=4,
                         precision=BF16(), optim=AdamW(lr=3e-4, weight_decay=0.1))

Every argument is the same strategy object a config group builds (``conf/<group>/*.yaml``
names its class and arguments); an argument left out is that group's plain-PyTorch default.
Nothing here imports Hydra or OmegaConf.

It speaks like the CLI: a progress bar on a terminal, progress lines otherwise (through the
``looplib`` logger; when the caller has configured no logging at all, a handler printing
INFO lines to stderr is added). ``metrics=PATH`` writes that run's rows to PATH, starting the
file afresh (a warning says so when it held an earlier run's rows): it never appends.
``logger=`` takes the same trackers as ``+logger=`` (``looplib.loggers``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from .accumulation import Accumulation
from .peft import FullModel
from .compile import Compile
from .data import Epochs, build_loader
from .engines import Engine
from .evaluation import Evaluation
from .loggers import Logger, Run
from .loop import TrainState, fit
from .loss import TokenCrossEntropy
from .optim import AdamW, OptimizerFactory, Schedule
from .precision import Precision
from .telemetry import Telemetry

log = logging.getLogger("looplib")


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
                log_every: int = 10, engine: Engine | None = None, collate_fn=None, progress: str = "auto",
                logger: Logger | None = None) -> Trained:
    """Set the pieces up in the order the CLI does (device, precision, adapter, compile,
    optimizer, schedule, loaders) and run ``looplib.fit``. ``collate_fn``: a corpus's
    ``collate`` for samples of different lengths (``looplib.data.InstructCorpus``);
    ``progress``: auto (a bar on a terminal), bar or lines; ``logger``: trackers
    (``looplib.loggers``), rank 0 only."""
    speak()
    engine = engine or Engine(device)
    precision = precision or Precision()
    precision.setup(engine.device)
    objective = objective or TokenCrossEntropy()
    evaluation = evaluation or Evaluation()
    compile = compile or Compile()
    model = compile.wrap(engine.setup(precision.convert((peft or FullModel()).wrap(model))))
    objective = compile.wrap_loss(objective)
    optimizer = (optim or AdamW()).build(model)  # the command line's defaults (looplib.optim.LR, ...)
    scheduler = (schedule or Schedule()).build(optimizer, max_steps)
    train = build_loader(dataset, batch_size=batch_size, seed=seed, device=engine.device,
                         rank=engine.rank, world=engine.world_size, collate_fn=collate_fn)
    held_out = None
    if eval_dataset is not None:
        loader = build_loader(eval_dataset, batch_size=batch_size, seed=seed, shuffle=False, device=engine.device,
                              collate_fn=collate_fn)
        held_out = [b for _, b in zip(range(eval_batches), loader)]
    if metrics is not None and engine.is_main:
        metrics = fresh_file(Path(metrics))
    settings = dict(max_steps=max_steps, batch_size=batch_size, accum_steps=accum_steps, seed=seed,
                    max_grad_norm=max_grad_norm, eval_every=eval_every, eval_batches=eval_batches, log_every=log_every,
                    **{name: type(obj).__name__ for name, obj in (("model", model), ("objective", objective),
                       ("precision", precision), ("optimizer", optimizer), ("engine", engine))})
    run_dir = Path(metrics).parent if metrics is not None else Path.cwd()
    telemetry = Telemetry(metrics, log_every=log_every, total_steps=max_steps, device=engine.device,
                          enabled=engine.is_main, progress=progress, logger=logger,
                          run=Run(run_dir, settings, run_dir.name or "looplib"))
    telemetry.items = getattr(objective, "items", "tokens")  # tokens/s, or sequences/s
    try:
        state = fit(model, Epochs(train), objective=objective, optimizer=optimizer, scheduler=scheduler,
                    precision=precision, accumulation=Accumulation(accum_steps), engine=engine,
                    max_steps=max_steps, max_grad_norm=max_grad_norm, telemetry=telemetry,
                    eval_data=held_out, eval_every=eval_every, evaluator=evaluation)
        if held_out and not (eval_every and state.step % eval_every == 0):
            telemetry.eval(state.step, evaluation(model, held_out, objective, precision, engine))
        telemetry.finish("finished", {"metrics": str(metrics)} if metrics is not None else {})
    finally:
        telemetry.close()
    return Trained(model, optimizer, scheduler, state, telemetry.last_row.get("eval_loss"))


def speak() -> None:
    """Progress lines reach the caller as they do from the CLI: when nothing is configured
    (no handler on ``looplib`` nor on the root logger), add one that prints INFO to stderr."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s][looplib] %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the caller's later basicConfig() would print every line twice


def fresh_file(path: Path) -> Path:
    """``metrics=PATH`` holds this run's rows only: never appended to another run's."""
    if path.exists() and path.stat().st_size:
        log.warning("metrics=%s held an earlier run's rows: starting it afresh for this run", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path
