"""Data: a seeded, resumable sampler, the DataLoader builder, and the default corpus.

The default corpus needs no download: the Python standard library's own source files on the
machine running it, tokenised with a byte-level BPE tokenizer trained by ``tokenizers`` and
cached under ``$LOOPLIB_CACHE`` (default ``~/.cache/looplib``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Annotated, Iterator

from .schema import NonNegative, Positive, Range, Seed

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .errors import ConfigError

log = logging.getLogger("looplib")


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
        if self.shuffle:
            g = torch.Generator().manual_seed((self.seed + self.epoch) % 2**64)  # any 64-bit seed, any epoch
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        return order[self.rank::self.world][: self.n // self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start:])

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
                 drop_last: bool = False) -> DataLoader:
    """A DataLoader from the ``loader`` settings. ``pin_memory: auto`` pins when training on CUDA."""
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
                      pin_memory=bool(pin_memory), drop_last=drop_last, generator=generator, **extra)


class TokenChunks(Dataset):
    """Consecutive, non-overlapping windows of a token stream: inputs and next-token labels."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i):
        chunk = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class RandomTokens(Dataset):
    """Seeded random token ids: for tests, benchmarks and golden losses (identical everywhere)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0, num_classes: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (n, seq_len + (num_classes == 0)), generator=g)
        self.labels = torch.randint(0, num_classes, (n,), generator=g) if num_classes else None

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        ids = self.input_ids[i]
        if self.labels is not None:
            return {"input_ids": ids, "labels": self.labels[i]}
        return {"input_ids": ids[:-1], "labels": ids[1:]}


class Corpus:
    """What a data config builds: a train split, a held-out split, and how to decode tokens."""

    train: Dataset
    eval: Dataset

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError


class RandomCorpus(Corpus):
    """Random tokens for both splits (tests, benchmarks, the BERT-sized classifier)."""

    def __init__(self, seq_len: Positive[int], vocab_size: Positive[int], n_train: Positive[int] = 512,
                 n_eval: NonNegative[int] = 64, num_classes: NonNegative[int] = 0, seed: Seed = 0):
        self.vocab_size = vocab_size
        self.train = RandomTokens(n_train, seq_len, vocab_size, seed, num_classes)
        self.eval = RandomTokens(n_eval, seq_len, vocab_size, (seed + 1) % 2**64, num_classes)

    def encode(self, text):
        return [ord(c) % self.vocab_size for c in text]


class PythonSource(Corpus):
    """The standard library's ``*.py`` files, byte-level BPE, split by file into train/eval."""

    def __init__(self, seq_len: Positive[int], vocab_size: Positive[int] = 2048, max_bytes: Positive[int] = 3_000_000,
                 eval_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.05, root: str | None = None, cache_dir: str | None = None):
        files = python_files(Path(root or sysconfig.get_paths()["stdlib"]), max_bytes)
        if len(files) < 2:  # one file at least for training, one held out
            raise ConfigError("data.max_bytes", f"{len(files)} Python file(s) under {root or 'the standard library'} "
                              f"within data.max_bytes={max_bytes}: too few to train on and hold one out",
                              "raise data.max_bytes, or point data.root at more Python files")
        key = hashlib.sha256(repr((vocab_size, [(str(f), f.stat().st_size) for f in files])).encode())
        cache = Path(cache_dir or os.environ.get("LOOPLIB_CACHE", "~/.cache/looplib")).expanduser()
        cache = cache / f"pysource-{key.hexdigest()[:16]}"
        self.tokenizer, tokens, bounds = load_token_cache(cache, files, vocab_size)
        n_eval_files = max(1, int(len(bounds) * eval_fraction))
        split = int(bounds[-n_eval_files - 1])
        self.vocab_size = vocab_size
        self.train = TokenChunks(tokens[:split], seq_len)
        self.eval = TokenChunks(tokens[split:], seq_len)

    def decode(self, ids):
        return self.tokenizer.decode(ids)

    def encode(self, text):
        return self.tokenizer.encode(text).ids


def python_files(root: Path, max_bytes: int) -> list[Path]:
    """Sorted ``*.py`` files of the standard library (tests and site-packages left out)."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts) or not path.is_file():
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return files


def load_token_cache(cache: Path, files: list[Path], vocab_size: int):
    """The tokenizer, tokens and file ends cached at ``cache``, built on first use. A cache that
    does not load (a crash mid-copy, a full disk, an edit) is removed and built again, with a
    warning; one that cannot be rebuilt either is an error naming its path."""
    from tokenizers import Tokenizer

    def read():
        tokenizer = Tokenizer.from_file(str(cache / "tokenizer.json"))
        saved = torch.load(cache / "tokens.pt", weights_only=True)
        tokens, bounds = saved["tokens"], saved["file_ends"]
        if tokens.dim() != 1 or bounds.dim() != 1 or not len(bounds) or int(bounds[-1]) != len(tokens):
            raise ValueError("tokens.pt does not hold the token stream it describes")
        return tokenizer, tokens, bounds

    try:
        if not (cache / "tokens.pt").exists():
            build_token_cache(files, vocab_size, cache)
    except OSError as err:
        raise ConfigError("data", f"cannot write the token cache {cache} ({err})",
                          "point LOOPLIB_CACHE (or data.cache_dir) at a writable directory") from None
    try:
        return read()
    except Exception as err:  # noqa: BLE001 - whatever a damaged file raises: rebuild it
        log.warning("the token cache %s is unreadable (%s): removing and rebuilding it", cache,
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
    try:
        shutil.rmtree(cache, ignore_errors=True)
        build_token_cache(files, vocab_size, cache)
        return read()
    except Exception as err:  # noqa: BLE001
        raise ConfigError("data", f"the token cache {cache} is unreadable and could not be rebuilt "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})",
                          f"delete it (rm -r {cache}) or point LOOPLIB_CACHE at a writable directory") from None


def build_token_cache(files: list[Path], vocab_size: int, cache: Path) -> None:
    """Train the tokenizer and tokenise every file once; written atomically (tmp + rename)."""
    from tokenizers import ByteLevelBPETokenizer

    log.info("training a %d-token byte-level BPE tokenizer on %d Python files (cached in %s)",
             vocab_size, len(files), cache)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    eot = tok.token_to_id("<|endoftext|>")
    ids, ends = [], []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids + [eot])
        ends.append(len(ids))
    dtype = torch.int16 if vocab_size <= 32767 else torch.int32
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=cache.name + ".tmp"))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        torch.save({"tokens": torch.tensor(ids, dtype=dtype), "file_ends": torch.tensor(ends)}, tmp / "tokens.pt")
    except BaseException:  # a full disk, a signal: leave no half-written cache behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, cache)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
