"""``batch_size=auto``: the largest micro-batch that fits, and the accumulation that keeps the
global batch unchanged (the guides' order: fill the device first, then accumulate).

Each candidate micro-batch runs one step of the real loop (``looplib.fit``) on samples of the
training set, with an optimizer that changes nothing. A CUDA out-of-memory error is recovered from (references dropped, gradients set to
None, the caching allocator emptied) and the previous size is kept. The RNG state is put
back afterwards, so an auto run trains exactly like the same sizes typed by hand.
"""
from __future__ import annotations

import gc
import logging
from typing import Callable

import torch
from torch.utils.data import default_collate

from ..accumulation import candidates
from ..errors import ConfigError
from ..loop import fit

log = logging.getLogger("looplib")



def find_micro_batch(fits: Callable[[int], bool], per_rank: int) -> tuple[int | None, list[tuple[int, bool]]]:
    """The largest candidate for which ``fits(size)`` holds, and what was tried."""
    eights, small = candidates(per_rank)
    tried, best = [], None
    for size in eights:
        ok = fits(size)
        tried.append((size, ok))
        if not ok:
            break
        best = size
    if best is None:
        for size in small:
            ok = fits(size)
            tried.append((size, ok))
            if ok:
                best = size
                break
    return best, tried


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError)


def free_memory(model: torch.nn.Module, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class NoStep(torch.optim.Optimizer):
    """An optimizer that changes nothing: probing runs the loop's whole step, weights untouched."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})  # an lr for the loop's constant schedule to read

    def step(self, closure=None):
        return None


def probe(job, reserve_bytes: int = 0) -> Callable[[int], bool]:
    """``fits(size)``: one optimizer step of the real loop (``looplib.fit``: to the device,
    forward and loss under the precision, backward, unscale, clip) on ``size`` training samples,
    with an optimizer that changes nothing and ``reserve_bytes`` (the optimizer state to come)
    held aside on a GPU. Every rank probes the same sizes; a size fits only if it fits on all."""
    data, engine, model = job.data, job.engine, job.model
    collate = data.collate or default_collate  # padded data: the corpus's own
    params = [p for p in model.parameters() if p.requires_grad]

    def fits(size: int) -> bool:
        ballast, ok = None, True
        scaler = job.precision.state_dict()  # fp16: a probe's overflow must not move the loss scale
        try:
            if reserve_bytes and engine.device.type == "cuda":
                ballast = torch.empty(reserve_bytes, dtype=torch.uint8, device=engine.device)
            batch = collate([data.train[i % len(data.train)] for i in range(size)])
            fit(model, [batch], objective=job.objective, optimizer=NoStep(params), max_steps=1,
                precision=job.precision, engine=engine, max_grad_norm=job.settings.max_grad_norm)
        except Exception as err:  # noqa: BLE001 - anything but OOM is re-raised
            if not is_out_of_memory(err):
                raise
            ok = False
        finally:
            del ballast
            job.precision.load_state_dict(scaler)
            free_memory(model, engine.device)
        return not engine.ranks.any(not ok)

    return fits


def resolve(job, reserve_bytes: int = 0) -> tuple[int, int]:
    """The micro-batch and accumulation for ``batch_size=auto``: the largest micro-batch that fits
    and the accumulation that keeps ``global_batch_size``. Probing consumes no randomness."""
    s, world = job.settings, job.engine.world_size
    if s.global_batch_size % world:
        raise ConfigError("global_batch_size", f"global_batch_size={s.global_batch_size} does not split over "
                          f"{world} processes", f"use a multiple of {world}")
    per_rank = s.global_batch_size // world
    rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    was_training = job.model.training
    try:
        best, tried = find_micro_batch(probe(job, reserve_bytes), per_rank)
    finally:
        torch.random.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        job.model.train(was_training)
    if job.engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.engine.device)
    if best is None:
        raise ConfigError("batch_size", f"batch_size=auto: not even a micro-batch of 1 fits on {job.engine.device}",
                          "turn on +checkpointing=blocks, +precision=bf16 or +optim=adam8bit "
                          "(python -m looplib.plan shows where the memory goes)")
    log.info("batch_size=auto: micro-batch %d x %d accumulation steps x %d process(es) = global batch %d "
             "(tried %s)", best, per_rank // best, world, s.global_batch_size,
             ", ".join(f"{n}:{'fits' if ok else 'out of memory'}" for n, ok in tried))
    return best, per_rank // best
