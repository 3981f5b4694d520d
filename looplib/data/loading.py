"""From a dataset to batches: a seeded, resumable sampler, the endless epoch stream, the DataLoader.

The sampler's position *is* the data position: an ``EpochSampler`` at (epoch, start) yields
the same indices in every process and after every resume, and every dataset in this package
maps an index to the same sample every time (windows, examples and packs are fixed when the
corpus is built), so exact resume needs nothing but (epoch, batches seen).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import ConfigError
from .packing import IGNORE


class EpochSampler(Sampler[int]):
    """Indices of one epoch: a permutation seeded by (seed, epoch), split across ranks.

    Each rank takes every ``world``-th index of the same permutation (as DistributedSampler
    does); ``start`` skips indices already consumed this epoch, for exact resume.
    """

    def __init__(self, n: int, *, seed: int, shuffle: bool = True, rank: int = 0, world: int = 1):
        self.n, self.seed, self.shuffle, self.rank, self.world = n, seed, shuffle, rank, world
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def order(self) -> list[int]:
        return self.indices().tolist()

    def indices(self) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed((self.seed + self.epoch) % 2**64)  # any 64-bit seed, any epoch
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        return order[self.rank::self.world][: self.n // self.world]

    def __iter__(self) -> Iterator[int]:
        # a tensor handed out in slices: millions of windows never become one list of Python ints
        rest = self.indices()[self.start:]
        return (i for chunk in rest.split(1 << 16) for i in chunk.tolist())

    def __len__(self) -> int:
        return self.n // self.world - self.start


class Epochs:
    """An endless stream of epochs over a loader (any re-iterable of batches will do; a
    DataLoader whose sampler is an ``EpochSampler`` gets per-epoch seeding and resume).

    Iterating yields one iterable of batches per epoch; ``epoch`` and ``batches_seen`` say
    where the stream is (the resume position)."""

    def __init__(self, loader: DataLoader, epoch: int = 0, batches_seen: int = 0):
        self.loader, self.epoch, self.batches_seen = loader, epoch, batches_seen
        self.wait_s = 0.0  # host time spent waiting for the loader (telemetry's data_wait_share)
        if sized(loader) and len(loader) == 0:  # known before any batch is drawn
            raise empty_epoch(loader)

    def __iter__(self):
        sampler = getattr(self.loader, "sampler", None)
        while True:
            if isinstance(sampler, EpochSampler):
                sampler.set_epoch(self.epoch, self.batches_seen * (self.loader.batch_size or 1))
                if self.loader.generator is not None:  # worker seeds: a function of (seed, epoch)
                    self.loader.generator.manual_seed((sampler.seed * 100_003 + self.epoch) % 2**64)
            whole = self.batches_seen == 0  # (a resumed epoch may have nothing left: that is fine)
            yield self._count(self.loader)
            if whole and self.batches_seen == 0:  # an endless stream of empty epochs would spin forever
                raise empty_epoch(self.loader)
            self.epoch, self.batches_seen = self.epoch + 1, 0

    def _count(self, loader):
        t0 = time.perf_counter()
        batches = iter(loader)  # starting workers is waiting too
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.wait_s += time.perf_counter() - t0
            self.batches_seen += 1
            yield batch
            t0 = time.perf_counter()


def sized(loader) -> bool:
    try:
        len(loader)
    except TypeError:  # an IterableDataset without __len__
        return False
    return True


def empty_epoch(loader) -> ConfigError:
    """The one-line error for training data that yields no batch (so no loop spins on it)."""
    dataset, batch = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
    sampler = getattr(loader, "sampler", None)
    world = getattr(sampler, "world", 1)
    n = len(dataset) if dataset is not None and sized(dataset) else "no"
    shape = f"{n} training sequences" + (f" over {world} ranks" if world > 1 else "")
    shape += f" for batch_size={batch}" if batch else ""
    shape += " with drop_last" if getattr(loader, "drop_last", False) else ""
    return ConfigError("data", f"the training data yields no batch ({shape})",
                       "give it more data (e.g. data.n_train, a corpus longer than one sequence of "
                       "model.seq_len tokens) or a smaller batch_size")


def build_loader(dataset: Dataset, *, batch_size: int, seed: int, shuffle: bool = True,
                 num_workers: int = 0, pin_memory: bool | str = "auto",
                 persistent_workers: bool = False, prefetch_factor: int | None = None,
                 device: torch.device | None = None, rank: int = 0, world: int = 1,
                 drop_last: bool = False, collate_fn: Callable | None = None) -> DataLoader:
    """A DataLoader from the ``loader`` settings. ``pin_memory: auto`` pins when training on CUDA;
    ``collate_fn``: the corpus's ``collate`` (dynamic padding), None for plain stacking."""
    if pin_memory == "auto":
        pin_memory = device is not None and torch.device(device).type == "cuda"
    sampler = EpochSampler(len(dataset), seed=seed, shuffle=shuffle, rank=rank, world=world)
    extra = {}
    if num_workers > 0:
        extra = {"persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor}
    # The loader's own generator: creating an iterator draws a worker base seed from it, and
    # drawing it from the global RNG would shift every later random number after a resume.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=bool(pin_memory), drop_last=drop_last, generator=generator,
                      collate_fn=collate_fn, **extra)


class HeldOut(Dataset):
    """One rank's share of the held-out set: ``dataset[i]`` for each ``i`` of ``indices``; ``-1``
    is padding, a copy of a real sample whose labels are all ``IGNORE`` (no loss, not counted),
    so that every rank runs as many batches as the others (a sharded model's forward is collective)."""

    def __init__(self, dataset: Dataset, indices: list[int], pad_from: int):
        self.dataset, self.indices, self.pad_from = dataset, indices, pad_from

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, j):
        i = self.indices[j]
        if i >= 0:
            return self.dataset[i]
        sample = self.dataset[self.pad_from]
        if not isinstance(sample, dict) or "labels" not in sample:
            raise ConfigError("eval_samples", "the held-out samples have no labels to mask, so they cannot be split "
                              "evenly over the processes", "use eval_samples=N with N a multiple of the process count")
        return {**sample, "labels": torch.full_like(torch.as_tensor(sample["labels"]), IGNORE)}


def held_out(dataset: Dataset | None, samples: int | None, *, batch_size: int, rank: int = 0, world: int = 1,
             collate_fn: Callable | None = None, device: torch.device | None = None) -> list:
    """The batches of this rank's share of the fixed held-out set: ``samples`` sequences (None:
    all) spread evenly over ``dataset`` (the same ones whatever the batch size or the number of
    processes), every ``world``-th of them for rank ``rank``, padded so that every rank has as
    many (``HeldOut``). ``evaluate`` adds the ranks' sums up: the loss is that of the whole set."""
    n = len(dataset) if dataset is not None else 0
    k = n if samples is None else min(n, samples)
    if k == 0:
        return []
    chosen = [i * n // k for i in range(k)]  # evenly spread, distinct (n >= k)
    share = chosen[rank::world]
    share += [-1] * (-(-k // world) - len(share))
    pin = device is not None and torch.device(device).type == "cuda"
    return list(DataLoader(HeldOut(dataset, share, chosen[0]), batch_size=batch_size, shuffle=False,
                           collate_fn=collate_fn, pin_memory=pin,
                           generator=torch.Generator()))  # (its own: iterating draws no number from the global RNG)


def small_data(n_train: int | None, batch_size: int, accum_steps: int, world: int = 1) -> int:
    """The micro-batch a run really trains with (no larger than the training sequences per rank),
    and one warning line with the real figures when the data is smaller than the batch settings
    assume: a micro-batch larger than the training set per rank, or an epoch shorter than one
    accumulation window (each optimizer step then sees some sequences more than once)."""
    per_rank = (n_train or 0) // max(world, 1)
    if not n_train or per_rank == 0:
        return batch_size  # unknown length, or no batch at all (refused where the epochs are made)
    real = min(batch_size, per_rank)
    batches = -(-per_rank // batch_size)  # micro-batches per epoch, the last one possibly short
    ranks = f" per rank ({n_train} over {world} processes)" if world > 1 else ""
    problems = []
    if batch_size > per_rank:
        problems.append(f"batch_size={batch_size} is larger than the {per_rank} training sequences{ranks}: each "
                        f"micro-batch holds {real}")
    if batches < accum_steps:
        problems.append(f"an epoch is {batches} micro-batch{'es' if batches > 1 else ''} ({per_rank} sequences{ranks}), "
                        f"fewer than accum_steps={accum_steps}: each optimizer step sees some sequences "
                        f"{-(-accum_steps // batches)} times")
    if problems:
        logging.getLogger("looplib").warning("small data: %s; so each optimizer step trains on %d x %d sequences "
                                             "(give more data, or lower batch_size / accum_steps)",
                                             "; ".join(problems), real, accum_steps)
    return real
