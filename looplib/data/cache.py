"""Tokenise once: a token cache under ``$LOOPLIB_CACHE``, read through a memory map.

A cache directory ``<kind>-<key>/`` holds

- ``tokens.bin``: every document's token ids back to back (uint16, or uint32 for vocabularies
  over 65536), read through ``mmap``: nothing is loaded up front, DataLoader workers share the
  operating system's page cache, and ``TokenFile`` unmaps what it has read every few reads
  (``madvise(MADV_DONTNEED)``), so a corpus larger than RAM trains with bounded memory;
- ``target.bin`` (instruct data): one byte per token, 1 where the token carries loss;
- ``offsets.npy``: where each document starts (and the end);
- ``meta.json``, written last: the format, sizes, labels (classification data).

The key hashes the files' contents, the reader settings and the tokenizer, so a change to any
of them tokenises again. A cache is written to a temporary directory beside its place and
renamed into it; one whose files do not match ``meta.json`` (a crash, a full disk, an edit) is
removed and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..atomic import make_dir_beside
from ..errors import ConfigError, disk_full
from .tokenizer import cache_root

log = logging.getLogger("looplib")

FORMAT = 1
RELEASE_READS, RELEASE_BYTES = 8, 16 << 20   # how often a TokenFile unmaps what it has read
PROGRESS_BYTES = 32 << 20   # inputs larger than this get a progress bar (on a terminal)


class TokenFile:
    """A read-only, lazily opened memory map of a flat array of ids (one per process: the map
    is not pickled into DataLoader workers, each opens its own over the same page cache)."""

    def __init__(self, path: Path, dtype: str, length: int):
        self.path, self.dtype, self.length = Path(path), np.dtype(dtype), length
        self._map, self._array, self._reads, self._bytes = None, None, 0, 0

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            if self.length == 0:
                self._array = np.zeros(0, self.dtype)
            else:
                with open(self.path, "rb") as fh:
                    self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                self._array = np.frombuffer(self._map, self.dtype, self.length)
        return self._array

    def read(self, start: int, stop: int) -> np.ndarray:
        """A copy of ``[start, stop)``. The pages read stay in the page cache (shared between
        processes, reclaimable) but are unmapped from this process every ``RELEASE_READS``
        reads or ``RELEASE_BYTES`` bytes: a read fault may map far more than was asked for
        (fault-around, large folios), so short reads are counted as well as bytes."""
        out = np.array(self.array[start:stop])
        self._reads, self._bytes = self._reads + 1, self._bytes + out.nbytes
        if (self._reads >= RELEASE_READS or self._bytes >= RELEASE_BYTES) and hasattr(mmap, "MADV_DONTNEED") \
                and self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)
            self._reads, self._bytes = 0, 0
        return out

    def __len__(self):
        return self.length

    def __getstate__(self):
        return {"path": self.path, "dtype": self.dtype.str, "length": self.length}

    def __setstate__(self, state):
        self.__init__(state["path"], state["dtype"], state["length"])


@dataclass
class Tokenised:
    """A loaded cache: the documents' ids, where each starts, and per-document extras."""
    tokens: TokenFile
    offsets: np.ndarray              # n_docs + 1 positions
    target: TokenFile | None = None  # instruct: 1 where the token carries loss
    labels: list | None = None       # classification: each document's raw label
    path: Path | None = None

    def __len__(self):
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class Writer:
    """Appends documents to a cache being built."""

    def __init__(self, root: Path, dtype: str, with_target: bool):
        self.root, self.dtype = root, np.dtype(dtype)
        self.tokens = open(root / "tokens.bin", "wb")
        self.target = open(root / "target.bin", "wb") if with_target else None
        self.ends, self.labels, self.n = [], [], 0

    def add(self, ids, target=None, label=None, end: bool = True) -> None:
        """Append ids to the current document; ``end`` closes it (a large file comes in pieces)."""
        self.tokens.write(np.asarray(ids, dtype=self.dtype).tobytes())
        if self.target is not None:
            self.target.write(np.asarray(target, dtype=np.uint8).tobytes())
        self.n += len(ids)
        if end:
            self.ends.append(self.n)
            if label is not None:
                self.labels.append(label)

    @property
    def documents(self) -> int:
        return len(self.ends)

    def close(self) -> dict:
        self.tokens.close()
        if self.target is not None:
            self.target.close()
        np.save(self.root / "offsets.npy", np.array([0] + self.ends, dtype=np.int64))
        return {"format": FORMAT, "dtype": self.dtype.str, "tokens": self.n, "documents": len(self.ends),
                "target": self.target is not None, "labels": self.labels or None}


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps([FORMAT, *parts], sort_keys=True, default=str).encode()).hexdigest()[:20]


def load(path: Path) -> Tokenised | None:
    """The cache at ``path``, or None when it is missing or does not match its ``meta.json``."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            return None
        size = np.dtype(meta["dtype"]).itemsize
        if (path / "tokens.bin").stat().st_size != meta["tokens"] * size:
            return None
        if meta["target"] and (path / "target.bin").stat().st_size != meta["tokens"]:
            return None
        offsets = np.load(path / "offsets.npy")
        if len(offsets) != meta["documents"] + 1 or offsets[-1] != meta["tokens"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Tokenised(TokenFile(path / "tokens.bin", meta["dtype"], meta["tokens"]), offsets,
                     TokenFile(path / "target.bin", "u1", meta["tokens"]) if meta["target"] else None,
                     meta["labels"], path)


def build(name: str, key: str, vocab_size: int, fill: Callable[[Writer], None], with_target: bool = False,
          root: Path | None = None) -> Tokenised:
    """The cache ``name-key`` (under ``root``, default ``$LOOPLIB_CACHE``): loaded when valid, else
    built by ``fill(writer)`` in a temporary directory and renamed into place (an error leaves
    nothing behind)."""
    path = (root or cache_root()) / f"{name}-{key}"
    found = load(path)
    if found is not None:
        return found
    if path.exists():
        log.warning("the token cache %s is incomplete or corrupt: building it again", path)
        shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_dir_beside(path, path.name + ".tmp")
    except OSError as err:
        if disk_full(err, str(path)) is not None:
            raise disk_full(err, str(path)) from None
        raise ConfigError("data", f"cannot write the token cache {path} ({err})",
                          "point LOOPLIB_CACHE (or data.cache_dir) at a writable directory") from None
    try:
        writer = Writer(tmp, "<u2" if vocab_size <= 1 << 16 else "<u4", with_target)
        try:
            fill(writer)
        finally:
            meta = writer.close()
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            tmp.rename(path)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load(path)


def progress(total_bytes: int, what: str):
    """A byte-counting tqdm bar on a terminal for large inputs; a no-op otherwise."""
    from tqdm import tqdm

    show = total_bytes >= PROGRESS_BYTES and sys.stderr.isatty()
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenising {what}", disable=not show,
                leave=False)
