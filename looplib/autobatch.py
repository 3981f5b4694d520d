"""``batch_size=auto``: the largest micro-batch that fits, and the accumulation that keeps the
global batch unchanged (the guides' order: fill the device first, then accumulate).

Each candidate micro-batch runs one real forward and backward on samples of the training
set. A CUDA out-of-memory error is recovered from (references dropped, gradients set to
None, the caching allocator emptied) and the previous size is kept. The RNG state is put
back afterwards, so an auto run trains exactly like the same sizes typed by hand.
"""
from __future__ import annotations

import gc
import logging
from typing import Callable

import torch
from omegaconf import DictConfig, open_dict
from torch.utils.data import default_collate

from .accumulation import candidates
from .errors import ConfigError

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


def probe(job, reserve_bytes: int = 0) -> Callable[[int], bool]:
    """``fits(size)``: one forward and backward of ``size`` training samples on the device, with
    ``reserve_bytes`` (the optimizer state to come) held aside on a GPU."""
    dataset, engine, model = job.corpus.train, job.engine, job.model
    collate = getattr(job.corpus, "collate", None) or default_collate  # padded data: the corpus's own

    def fits(size: int) -> bool:
        ballast = None
        try:
            if reserve_bytes and engine.device.type == "cuda":
                ballast = torch.empty(reserve_bytes, dtype=torch.uint8, device=engine.device)
            batch = engine.to_device(collate([dataset[i % len(dataset)] for i in range(size)]))
            with job.precision.autocast():
                loss = job.objective(model, batch) / max(1, job.objective.count(batch))
            job.precision.backward(loss)
            del loss, batch
            return True
        except Exception as err:  # noqa: BLE001 - anything but OOM is re-raised
            if not is_out_of_memory(err):
                raise
            return False
        finally:
            del ballast
            free_memory(model, engine.device)

    return fits


def resolve(job, reserve_bytes: int = 0) -> None:
    """Replace ``batch_size=auto`` by the chosen micro-batch and set ``accum_steps`` (in the
    settings and in the config that is saved with the run)."""
    s, world = job.settings, job.engine.world_size
    if s.global_batch_size % world:
        raise ConfigError("global_batch_size", f"global_batch_size={s.global_batch_size} does not split over "
                          f"{world} processes", f"use a multiple of {world}")
    per_rank = s.global_batch_size // world
    rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    was_training = job.model.training
    job.model.train()
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
    s.batch_size, s.accum_steps = best, per_rank // best
    set_chosen(job.cfg, s.batch_size, s.accum_steps)
    log.info("batch_size=auto: micro-batch %d x %d accumulation steps x %d process(es) = global batch %d "
             "(tried %s)", s.batch_size, s.accum_steps, world, s.global_batch_size,
             ", ".join(f"{n}:{'fits' if ok else 'out of memory'}" for n, ok in tried))


def set_chosen(cfg: DictConfig, batch_size: int, accum_steps: int) -> None:
    with open_dict(cfg):
        cfg.batch_size, cfg.accum_steps = batch_size, accum_steps
