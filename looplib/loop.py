"""The training loop. One function, read top to bottom; every technique is a strategy object.

Per micro-batch: batch to device -> forward and loss under the precision context -> backward
through the precision strategy. At the end of each accumulation window only: unscale, clip,
optimizer step, scheduler step, *then* zero the gradients (step-then-zero).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from .accumulation import Accumulation
from .data import Epochs
from .engines import Engine
from .evaluation import evaluate
from .precision import Precision
from .train_state import TrainState
from .telemetry import Telemetry


def fit(model: nn.Module, data: DataLoader | Epochs, *, objective, optimizer: torch.optim.Optimizer,
        max_steps: int, scheduler=None, precision: Precision | None = None,
        accumulation: Accumulation | None = None, engine: Engine | None = None,
        max_grad_norm: float | None = None, telemetry: Telemetry | None = None,
        eval_data=None, eval_every: int = 0, evaluator=None, checkpoints=None,
        state: TrainState | None = None, compile: EagerStep | None = None) -> TrainState:
    """Train ``model`` (already on ``engine``'s device) until ``state.step == max_steps``, or
    until ``checkpoints`` says stop (preemption: ``state.preempted`` is then True).
    ``checkpoints``: anything with ``after_step(state) -> stop`` (``looplib.store.saving.Checkpoints``);
    ``compile``: the compile strategy, whose ``clip_and_step`` ends each window (``EagerStep``'s)."""
    precision, accumulation = precision or Precision(), accumulation or Accumulation(1)
    compile = compile or EagerStep()  # looplib.compile.TorchCompile: the compiled clip-and-step
    engine, state = engine or Engine("cpu"), state or TrainState()
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    telemetry = telemetry or Telemetry(enabled=False, device=engine.device)
    checkpoints = checkpoints or NoCheckpoints()
    evaluator = evaluator or evaluate  # looplib.evaluation: e.g. half-precision weights
    epochs = data if isinstance(data, Epochs) else Epochs(data)
    telemetry.watch(optimizer, epochs)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]  # walked once, not twice per step
    if state.step >= max_steps:
        return state
    for window in accumulation.windows(epochs, objective.count):
        items = engine.global_items(window.items)  # normalise by the whole window, all ranks
        for i, batch in enumerate(window.batches):
            batch = engine.to_device(batch)
            with engine.accumulating(model, last=i == len(window) - 1):  # DDP: sync on the last only
                with precision.autocast():
                    loss = objective(model, batch) / items
                precision.backward(loss)
            telemetry.add(loss)
        grad_norm, skipped = compile.clip_and_step(optimizer, precision, params, max_grad_norm)  # unscale, clip, step
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)        # step, *then* zero
        state.end_window(epochs, updated=telemetry.updated(), skipped=skipped)
        telemetry.step(state.step, state.epoch, window, scheduler.get_last_lr()[0], grad_norm, state.skipped)
        if eval_data is not None and eval_every and state.step % eval_every == 0:
            telemetry.eval(state.step, evaluator(model, eval_data, objective, precision, engine))
        if checkpoints.after_step(state) or state.step >= max_steps:  # saves when due; preemption
            break
    return state


class NoCheckpoints:
    """The loop's default: nothing is saved, and nothing asks the loop to stop."""

    def after_step(self, state: TrainState) -> bool:
        return False


class EagerStep:
    """The end of an accumulation window in plain PyTorch, the verb the loop calls there:
    ``clip_and_step``. The compile strategy (``looplib.compile.Compile``) is one; with
    ``compile.optimizer=true`` it runs the same three in one compiled region instead."""

    def clip_and_step(self, optimizer, precision: Precision, params: list[torch.Tensor], max_norm: float | None):
        """fp16's unscale (once per step, before clipping), clipping, then the step, skipped if the
        gradients hold inf/NaN: ``(grad_norm, skipped)``."""
        precision.unscale(optimizer)
        grad_norm = clip_grad_norm(params, max_norm)
        return grad_norm, precision.step(optimizer, grad_norm)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor | None:
    """Clip to ``max_norm`` (None or 0: measure only). Returns the total gradient norm as a
    device tensor, without a host-device sync; None where the engine holds the gradients
    (DeepSpeed ZeRO partitions them and clips itself)."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return None
    if max_norm:
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad], foreach=True)
    # FSDP: the norm of sharded gradients is a replicated DTensor holding the global norm
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
