"""Tokenise once: a token cache under ``$LOOPLIB_CACHE``, read through a memory map.

A cache directory ``<kind>-<key>/`` holds

- ``tokens.bin``: every document's token ids back to back (uint16, or uint32 for vocabularies
  over 65536), read through ``mmap``: nothing is loaded up front, DataLoader workers share the
  operating system's page cache, and ``TokenFile`` unmaps what it has read every few reads
  (``madvise(MADV_DONTNEED)``), so a corpus larger than RAM trains with bounded memory;
- ``target.bin`` (instruct data): one byte per token, 1 where the token carries loss;
- ``offsets.npy``: where each document starts (and the end);
- ``meta.json``, written last: the format, sizes, labels (classification data), and the
  checksums of the other files: a CRC-32 of every ``CHUNK_BYTES`` of ``tokens.bin`` and
  ``target.bin``, computed as they are written, and one of ``offsets.npy``;
- ``checked.json``: when each large file was last checked in full (see ``verify``).

The key hashes the files' contents, the reader settings and the tokenizer, so a change to any
of them tokenises again. A cache is written to a temporary directory beside its place and
renamed into it; one whose files do not match ``meta.json`` (a crash, a full disk, an edit, a
file overwritten in place) is removed and rebuilt with a warning, never trained on.

What opening a cache checks (``verify``): sizes, and the checksums. A file up to
``FULL_CHECK_BYTES`` is checked in full every time (CRC-32 runs at several GB/s: about 1 ms for
the default job's 2 MB of tokens). A larger one is checked in full the first time it is opened
after any change through the file system (its size, mtime, ctime or inode differ from those
recorded after its last full check: an overwrite, a copy, a restore), and otherwise in
``SAMPLED_CHUNKS`` chunks picked at random plus the first and the last, so that a 100 GB cache
costs its full read once, not at every start of every rank.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import random
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..atomic import make_dir_beside
from ..errors import ConfigError, disk_full
from .lock import building
from .tokenizer import cache_root

log = logging.getLogger("looplib")

FORMAT = 2                   # the layout (2: with checksums); a cache in another is rebuilt in place
KEY_VERSION = 1              # part of every key: what the key means (unchanged by FORMAT 2)
CHUNK_BYTES = 4 << 20        # tokens.bin and target.bin carry one CRC-32 per 4 MiB
FULL_CHECK_BYTES = 1 << 30   # files up to 1 GiB are checked in full at every open
SAMPLED_CHUNKS = 8           # a larger, unchanged file: this many random chunks, the first and the last
CHECKED = "checked.json"     # stat of each large file at its last full check
RELEASE_READS, RELEASE_BYTES = 8, 16 << 20   # how often a TokenFile unmaps what it has read


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


class Chunked:
    """A file being written, with the CRC-32 of every ``CHUNK_BYTES`` of it computed on the way."""

    def __init__(self, path: Path):
        self.file, self.sums, self.crc, self.fill = open(path, "wb"), [], 0, 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        view = memoryview(data)
        while len(view):
            take = min(len(view), CHUNK_BYTES - self.fill)
            self.crc, self.fill, view = zlib.crc32(view[:take], self.crc), self.fill + take, view[take:]
            if self.fill == CHUNK_BYTES:
                self.sums.append(self.crc)
                self.crc, self.fill = 0, 0

    def close(self) -> list[int]:
        self.file.close()
        if self.fill:
            self.sums.append(self.crc)
            self.crc, self.fill = 0, 0
        return self.sums


class Writer:
    """Appends documents to a cache being built."""

    def __init__(self, root: Path, dtype: str, with_target: bool):
        self.root, self.dtype = root, np.dtype(dtype)
        self.tokens = Chunked(root / "tokens.bin")
        self.target = Chunked(root / "target.bin") if with_target else None
        self.ends, self.labels, self.n = [], [], 0
        self.ended: list[np.ndarray] = []   # ends added in bulk (``extend``), before those in ``ends``

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

    def extend(self, ids: np.ndarray, ends: np.ndarray) -> None:
        """Append many ids at once, a document ending after each position in ``ends`` (0..len(ids))."""
        if self.ends:
            self.ended.append(np.array(self.ends, np.int64))
            self.ends = []
        self.tokens.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.ended.append(self.n + np.asarray(ends, np.int64))
        self.n += len(ids)

    def open_tokens(self) -> int:
        """Ids appended since the last document ended."""
        last = self.ends[-1] if self.ends else next((int(e[-1]) for e in reversed(self.ended) if len(e)), 0)
        return self.n - last

    @property
    def documents(self) -> int:
        return len(self.ends) + sum(map(len, self.ended))

    def close(self) -> dict:
        sums = {"tokens.bin": self.tokens.close()}
        if self.target is not None:
            sums["target.bin"] = self.target.close()
        np.save(self.root / "offsets.npy", np.concatenate([[0], *self.ended, self.ends]).astype(np.int64))
        sums["offsets.npy"] = [crc_of(self.root / "offsets.npy")]
        return {"format": FORMAT, "dtype": self.dtype.str, "tokens": self.n, "documents": self.documents,
                "target": self.target is not None, "labels": self.labels or None,
                "chunk_bytes": CHUNK_BYTES, "checksums": sums}


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps([KEY_VERSION, *parts], sort_keys=True, default=str).encode()).hexdigest()[:20]


def crc_of(path: Path, start: int = 0, length: int | None = None, buffer: bytearray | None = None) -> int:
    """CRC-32 of ``length`` bytes of ``path`` from ``start`` (all of it by default), read in
    blocks through one buffer (plain reads: nothing is mapped into the process)."""
    buffer = buffer if buffer is not None else bytearray(CHUNK_BYTES)
    crc, left = 0, length if length is not None else os.path.getsize(path) - start
    with open(path, "rb", buffering=0) as fh:
        fh.seek(start)
        view = memoryview(buffer)
        while left > 0:
            n = fh.readinto(view[:min(left, len(buffer))])
            if not n:
                break
            crc, left = zlib.crc32(view[:n], crc), left - n
    return crc


def seal(path: Path, dtype: str, labels: list | None = None) -> dict:
    """Write ``meta.json``, checksums included, for a cache whose ``tokens.bin`` (``target.bin``)
    and ``offsets.npy`` were made some other way (e.g. written straight from another tool)."""
    sums, buffer = {}, bytearray(CHUNK_BYTES)
    for name in ("tokens.bin", "target.bin"):
        if (path / name).exists():
            size = (path / name).stat().st_size
            sums[name] = [crc_of(path / name, i, min(CHUNK_BYTES, size - i), buffer) for i in range(0, size, CHUNK_BYTES)]
    sums["offsets.npy"] = [crc_of(path / "offsets.npy")]
    offsets = np.load(path / "offsets.npy")
    meta = {"format": FORMAT, "dtype": np.dtype(dtype).str, "tokens": int(offsets[-1]), "documents": len(offsets) - 1,
            "target": "target.bin" in sums, "labels": labels, "chunk_bytes": CHUNK_BYTES, "checksums": sums}
    (path / "meta.json").write_text(json.dumps(meta))
    return meta


def stat_of(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def verify(path: Path, meta: dict) -> str | None:
    """Why the cache at ``path`` is not what was written (a size or a checksum differs), or None.
    See the module's docstring for which chunks are read."""
    chunk, sums = int(meta["chunk_bytes"]), meta["checksums"]
    if crc_of(path / "offsets.npy") != sums["offsets.npy"][0]:
        return "offsets.npy does not match its checksum"
    try:
        checked = json.loads((path / CHECKED).read_text())
    except (OSError, ValueError):
        checked = {}
    changed, buffer = False, bytearray(chunk)
    for name in ("tokens.bin", "target.bin") if meta["target"] else ("tokens.bin",):
        f, expected = path / name, sums[name]
        size = f.stat().st_size
        if len(expected) != -(-size // chunk):
            return f"{name} has {size} bytes, its checksums cover {len(expected)} chunks"
        full = size <= FULL_CHECK_BYTES or checked.get(name) != stat_of(f)
        picks = range(len(expected)) if full else sorted(
            {0, len(expected) - 1, *random.SystemRandom().sample(range(len(expected)), min(SAMPLED_CHUNKS, len(expected)))})
        for i in picks:
            if crc_of(f, i * chunk, min(chunk, size - i * chunk), buffer) != expected[i]:
                return (f"bytes {i * chunk}-{min(size, (i + 1) * chunk)} of {name} do not match the checksum written "
                        "when it was built (changed on disk since)")
        if full and size > FULL_CHECK_BYTES:
            checked[name], changed = stat_of(f), True
    if changed:
        try:  # (a read-only cache is checked in full at every open instead)
            tmp = path / f"{CHECKED}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(checked))
            os.replace(tmp, path / CHECKED)
        except OSError:
            pass
    return None


def load(path: Path) -> Tokenised | None:
    """The cache at ``path``, or None when it is missing or does not match its ``meta.json``."""
    return opened(path)[0]


def opened(path: Path) -> tuple[Tokenised | None, str]:
    """The cache at ``path`` and "", or None and why not ("" when there is none)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        return None, "incomplete (no meta.json)" if path.exists() else ""
    except (OSError, ValueError) as err:
        return None, f"unreadable ({err})"
    try:
        if meta.get("format") != FORMAT:
            return None, f"in an older format ({meta.get('format')}, without checksums)"
        size = np.dtype(meta["dtype"]).itemsize
        if (path / "tokens.bin").stat().st_size != meta["tokens"] * size:
            return None, f"incomplete (tokens.bin has {(path / 'tokens.bin').stat().st_size} bytes, not {meta['tokens'] * size})"
        if meta["target"] and (path / "target.bin").stat().st_size != meta["tokens"]:
            return None, "incomplete (target.bin has the wrong size)"
        why = verify(path, meta)
        if why:
            return None, f"corrupt ({why})"
        offsets = np.load(path / "offsets.npy")
        if len(offsets) != meta["documents"] + 1 or offsets[-1] != meta["tokens"]:
            return None, "corrupt (offsets.npy does not match meta.json)"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        return None, f"corrupt ({type(err).__name__}: {err})"
    return Tokenised(TokenFile(path / "tokens.bin", meta["dtype"], meta["tokens"]), offsets,
                     TokenFile(path / "target.bin", "u1", meta["tokens"]) if meta["target"] else None,
                     meta["labels"], path), ""


def build(name: str, key: str, vocab_size: int, fill: Callable[[Writer], None], with_target: bool = False,
          root: Path | None = None) -> Tokenised:
    """The cache ``name-key`` (under ``root``, default ``$LOOPLIB_CACHE``): loaded when valid, else
    built by ``fill(writer)`` in a temporary directory and renamed into place (an error leaves
    nothing behind)."""
    path = (root or cache_root()) / f"{name}-{key}"
    found, why = opened(path)
    if found is not None:
        return found
    with building(path.parent, path.name, f"the token cache {path}"):  # one builder; the others wait, then open it
        return built(path, name, vocab_size, fill, with_target)


def built(path: Path, name: str, vocab_size: int, fill: Callable[[Writer], None], with_target: bool) -> Tokenised:
    found, why = opened(path)
    if found is not None:  # built while this process waited for the lock
        return found
    if path.exists():
        log.warning("the token cache %s is %s: building it again", path, why or "incomplete")
        shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_dir_beside(path, path.name + ".tmp")
    except OSError as err:
        if disk_full(err, str(path)) is not None:
            raise disk_full(err, str(path)) from None
        raise ConfigError("data", f"cannot write the token cache {path} ({err})",
                          "point LOOPLIB_CACHE (or data.cache_dir) at a writable directory") from None
    log.info("building the token cache %s", path)
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
