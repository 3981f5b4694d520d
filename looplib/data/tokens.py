"""``data=tokens``: token ids brought ready-made, as flat files of ids.

Two layouts are read, told apart by their first four bytes:

- a headered shard: 256 little-endian int32 (1,024 bytes) of which the first three are the magic
  number 20240520, the version (1: the ids are uint16; 2: uint32) and the number of ids, then the
  ids (the layout of llm.c's data scripts);
- anything else: the file is nothing but ids, uint16 (``dtype=uint16``, the layout nanoGPT's
  ``prepare.py`` writes) or uint32 (``dtype=uint32``);
- a Hugging Face ``datasets`` directory written by ``save_to_disk`` (its Arrow files): each row of
  ``column`` (default ``input_ids``), a list of ids, is one document.

The files (one, a directory, a glob or a list, in the order given) are copied once into the
token cache of ``cache.py`` (``tokens-KEY/``: checked, memory-mapped, built by one process per
entry), cut into documents after each end-of-text id (``eos_id``; none: blocks of
``block_tokens`` ids), and from there on are what a tokenised text corpus is: the held-out split
by document, windows, the resume position and the run's identity (the files' digests).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import ConfigError
from ..schema import Positive, Seed
from . import identity
from .identity import Expected
from .cache import build as build_cache, cache_key
from .corpus import Corpus
from .files import EvalFraction, describe_files, split_documents
from .index import file_digests
from .packing import TokenWindows
from .readers import arrow_batches, resolve_files

MAGIC, HEADER_INTS = 20240520, 256
VERSIONS = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
COPY_IDS = 16 << 20   # ids copied at once (64 MB of uint32 at most)
ROWS = -1             # layout()'s offset for an Arrow file of a saved dataset: a document per row


def layout(path: Path, dtype: str, key: str, column: str = "input_ids") -> tuple[int, np.dtype, int]:
    """``(offset, dtype, count)`` of the ids in ``path``; a file that is neither layout is refused.
    An Arrow file of a saved dataset: offset ``ROWS`` (a document per row of ``column``)."""
    if path.suffix.lower() == ".arrow":
        return ROWS, np.dtype("<i8"), sum(len(ids) for ids in arrow_documents(path, column, key))
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = np.frombuffer(fh.read(12).ljust(12, b"\0"), "<i4")
    if head[0] == MAGIC:
        if int(head[1]) not in VERSIONS:
            raise ConfigError(key, f"{path} has the header of a token shard but version {int(head[1])} (1: uint16 "
                              "ids, 2: uint32 ids)", "give shards of version 1 or 2")
        kind, count = VERSIONS[int(head[1])], int(head[2])
        if size != HEADER_INTS * 4 + count * kind.itemsize:
            raise ConfigError(key, f"{path}'s header says {count} ids of {kind.itemsize} bytes, but it holds "
                              f"{size - HEADER_INTS * 4} bytes after the header (cut short, or not a shard)",
                              "write the shard again")
        return HEADER_INTS * 4, kind, count
    kind = np.dtype("<u4" if dtype == "uint32" else "<u2")
    if size % kind.itemsize:
        raise ConfigError(key, f"{path} holds {size} bytes, not a whole number of {dtype} ids",
                          "give files of token ids (data.dtype says their width)")
    return 0, kind, size // kind.itemsize


def arrow_documents(path: Path, column: str, key: str):
    """The rows of ``column`` (lists of ids) in an Arrow file of a saved dataset, batch by batch,
    as numpy arrays: one document each."""
    for batch in arrow_batches(path, key):
        if column not in batch.schema.names:
            raise ConfigError("data.column", f"{path} has no column {column!r} (columns: "
                              f"{', '.join(batch.schema.names) or 'none'})",
                              "set data.column=NAME to the column of token ids, or read text with data=text "
                              "data.field=NAME")
        values = batch.column(column)
        try:
            flat = values.flatten().to_numpy(zero_copy_only=False)
        except (AttributeError, TypeError, ValueError):
            raise ConfigError("data.column", f"{path}'s column {column!r} holds {values.type}, not lists of token ids",
                              "give the column of token ids (data.column=...), or read text with data=text") from None
        offsets = values.offsets.to_numpy(zero_copy_only=False)
        for i in range(len(values)):
            yield flat[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]]


class TokenCorpus(Corpus):
    """``data=tokens``: files of token ids (see the module's docstring)."""

    def __init__(self, path: str | list[str] | None, seq_len: Positive[int], vocab_size: Positive[int] = 50257,
                 eos_id: int | None = 50256, eval_path: str | list[str] | None = None,
                 eval_fraction: EvalFraction = 0.05, seed: Seed = 0, dtype: Literal["uint16", "uint32"] = "uint16",
                 block_tokens: Positive[int] = 1 << 16, column: str = "input_ids", expected: Expected | None = None):
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ConfigError("data.eos_id", f"data.eos_id={eos_id} is not an id of a {vocab_size}-token vocabulary",
                              "give the end-of-text id of the tokenizer the files were made with, or data.eos_id=null")
        self.seq_len, self.vocab_size, self.eos_id, self.pad_id = seq_len, vocab_size, eos_id, eos_id
        self.block, self.dtype, self.column = block_tokens, dtype, column
        files = resolve_files(path, "data.path")
        eval_files = resolve_files(eval_path, "data.eval_path") if eval_path else []
        layouts = {key: [layout(f, dtype, key, column) for f in fs] for key, fs in (("data.path", files),
                                                                           ("data.eval_path", eval_files))}
        for key, fs in (("data.path", files), ("data.eval_path", eval_files)):
            if fs and not any(n for *_, n in layouts[key]):
                raise ConfigError(key, f"{describe_files(fs)} holds no token ids", "give files with ids in them")
        settings = {"vocab_size": vocab_size, "eos_id": eos_id, "dtype": dtype, "block": block_tokens,
                    **({"column": column} if any(f.suffix.lower() == ".arrow" for f in files + eval_files) else {})}
        hashed, in_train = list(dict.fromkeys(files + eval_files)), set(files)
        at = {f: i for i, f in enumerate(hashed)}

        def built(both):  # all of it before the digests' index is written: a refused run writes nothing
            digests, eval_digests = [both[at[f]] for f in files], [both[at[f]] for f in eval_files]
            train_part = identity.part(files, digests)
            self.identity = {"train": train_part, "eval": identity.part(eval_files, eval_digests) if eval_files else {
                "digest": identity.digest_over("split", train_part["digest"], eval_fraction, seed)},
                "tokenizer": {"digest": identity.digest_over("tokens", settings)}}
            identity.check(self.identity, expected)  # a resume whose files changed: refused before anything is copied
            self.split(files, digests, eval_files, eval_digests, layouts, settings, eval_fraction, seed, path)

        file_digests(hashed, lambda f: "data.path" if f in in_train else "data.eval_path", then=built)

    def split(self, files, digests, eval_files, eval_digests, layouts, settings, eval_fraction, seed, path) -> None:
        seq_len = self.seq_len
        data = self.copy(files, digests, layouts["data.path"], "data.path", settings)
        if eval_files:
            held = self.copy(eval_files, eval_digests, layouts["data.eval_path"], "data.eval_path", settings)
            self.train_docs, self.eval_docs = np.arange(len(data)), np.arange(len(held))
            eval_key = "data.eval_path"
        else:
            held, eval_key = data, "data.eval_fraction"
            self.train_docs, self.eval_docs = split_documents(len(data), eval_fraction, seed, path)
        self.train = TokenWindows(data, self.train_docs, seq_len)
        self.eval = TokenWindows(held, self.eval_docs, seq_len)
        for split, key, what in ((self.train, "data.path", "the training split"), (self.eval, eval_key, "the held-out split")):
            if len(split) == 0 and (split is self.train or len(self.eval_docs)):
                raise ConfigError(key, f"{what} holds {split.n_tokens} ids, too few for one window of "
                                  f"seq_len + 1 = {seq_len + 1}", "give more ids, or a shorter model.seq_len")

    def fingerprint(self) -> dict:
        return self.identity

    def in_vocabulary(self, ids: np.ndarray, f: Path) -> None:
        if len(ids) and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise ConfigError("data.vocab_size", f"{f} holds id {bad}, outside a vocabulary of "
                              f"data.vocab_size={self.vocab_size}",
                              "set data.vocab_size to the size of the tokenizer the ids were made with")

    def encode(self, text: str) -> list[int]:
        """Ids written as numbers (no tokenizer comes with them: a sample is shown as ids, ``decode``)."""
        return [int(t) for t in text.split()]

    def copy(self, files, digests, layouts, key, settings):
        """The files' ids into the token cache, cut into documents (refused: an id outside the vocabulary)."""
        eos, block = self.eos_id, self.block

        def fill(writer):
            for f, (offset, kind, count) in zip(files, layouts):
                if offset == ROWS:  # a saved dataset: each row of the column one document
                    for document in arrow_documents(f, self.column, key):
                        self.in_vocabulary(document, f)
                        writer.extend(document, np.array([len(document)]))
                    continue
                ids = np.memmap(f, kind, "r", offset, (count,)) if count else np.zeros(0, kind)
                since = 0   # ids of the current document so far (no end-of-text id: cut every `block`)
                for start in range(0, count, COPY_IDS):
                    part = np.asarray(ids[start:start + COPY_IDS])
                    top = int(part.max())
                    if top >= self.vocab_size:
                        at = start + int(np.argmax(part >= self.vocab_size))
                        raise ConfigError("data.vocab_size", f"{f} holds id {top} (at position {at}), outside a "
                                          f"vocabulary of data.vocab_size={self.vocab_size}",
                                          "set data.vocab_size to the size of the tokenizer the files were made with")
                    if eos is not None:
                        ends = np.flatnonzero(part == eos) + 1
                    else:
                        ends = np.arange(block - since, len(part) + 1, block)
                        since = (since + len(part)) % block
                    writer.extend(part, ends)
                    del part
                if writer.open_tokens():
                    writer.extend(np.zeros(0, kind), np.array([0]))  # the file's last document ends with it
                del ids

        key_ = cache_key(settings, [(str(f), d) for f, d in zip(files, digests)])
        return build_cache("tokens", key_, self.vocab_size, fill)
