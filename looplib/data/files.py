"""The user's own files: ``FileCorpus`` (the tokenizer, tokenising once into the token cache of
``cache.py``, the held-out split) and ``TextCorpus`` (``data=text``: documents read back to back
in windows). Records with fields of their own are in ``records.py``."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Iterator, Literal

import numpy as np
import torch

from ..errors import ConfigError
from ..schema import Positive, Range, Seed
from .cache import Tokenised, build as build_cache, cache_key
from .progress import progress
from . import identity
from .identity import Expected
from .corpus import Corpus
from .index import hash_file
from .packing import PadCollate, TokenWindows
from .readers import content_digest, document_bound, file_digests, is_records, records, resolve_files, text_field, text_pieces
from .tokenizer import TokenizerInfo, load_tokenizer, train_tokenizer


EvalFraction = Annotated[float, Range(ge=0, lt=1)]   # 0: no held-out data
ENCODE_BATCH_CHARS = 2 << 20   # text handed to the tokenizer at once (its threads split the batch; it holds
                               # about 170 bytes per character until the batch is done)


class FileCorpus(Corpus):
    """The user's files: the tokenizer, tokenising once into the cache, the held-out split.

    Subclasses say what a unit of input is (``units``: text pieces and records as
    ``(segments, label, first, end)``, each segment ``(text, carries_loss)``) and how its
    ids are put together (``assemble``)."""

    kind = "text"
    # what the end-of-text token ends in these data ("documents", "completions"): a given tokenizer
    # without one is refused; None: not needed
    eos_ends: str | None = None

    def __init__(self, path, seq_len: int, tokenizer: str | None, vocab_size: int, eval_path, eval_fraction: float,
                 seed: int, errors: str, expected: Expected | None = None):  # looplib.schema: the subclasses'
        self.seq_len, self.errors, self.seed, self.chat = seq_len, errors, seed, None
        self.expected = expected  # a resume: the identity of the checkpoint (looplib.data.identity), else None
        files = resolve_files(path, "data.path")
        self.files = files
        eval_files = resolve_files(eval_path, "data.eval_path") if eval_path else []
        self.check_files(files, "data.path")
        self.check_files(eval_files, "data.eval_path")
        strict = lambda f: errors == "strict" and not is_records(f)  # noqa: E731 - (refused now, not after training)
        hashed = list(dict.fromkeys(files + eval_files))  # (a file in both splits is read once)
        at = {f: i for i, f in enumerate(hashed)}

        def built(both):  # all of it before the digests' index is written: a refused run writes nothing
            digests, eval_digests = [both[at[f]] for f in files], [both[at[f]] for f in eval_files]
            train_part = identity.part(files, digests)
            self.identity = {"train": train_part, "eval": identity.part(eval_files, eval_digests) if eval_files else {
                "digest": identity.digest_over("split", train_part["digest"], eval_fraction, seed)}}
            identity.check(self.identity, expected)  # a resume whose files changed: refused before tokenising
            if tokenizer is None:  # before training one (a given tokenizer's own refusals come first: they cost nothing)
                self.refuse_early(files, eval_files, eval_fraction, seed, path)
            self.info = self.tokenizer_for(tokenizer, vocab_size, files, digests)
            if tokenizer is not None:
                self.refuse_early(files, eval_files, eval_fraction, seed, path)
            self.tokenizer, self.tokenizer_source = self.info.tokenizer, self.info.source
            self.eos_id, self.pad_id = self.info.eos_id, self.info.pad_id
            self.vocab_size = max(vocab_size, self.info.vocab_size)
            try:
                self.made(files, digests, eval_files, eval_digests, eval_fraction, seed, path)
            except ConfigError:  # refused: a tokenizer trained by this run for nothing does not stay in the cache
                if self.info.trained_now is not None:
                    shutil.rmtree(self.info.trained_now, ignore_errors=True)
                raise

        in_train = set(files)
        file_digests(hashed, lambda f: "data.path" if f in in_train else "data.eval_path", strict, then=built)
        self.collate = PadCollate(self.pad_id) if self.padded else None

    def refuse_early(self, files, eval_files, eval_fraction, seed, path) -> None:
        """The refusals that the files' count, sizes and lines decide, before a tokenizer trains: no
        text at all, too few documents to hold some out. ``document_bound`` counts documents
        without parsing (at most: what it refuses, the real count refuses too); when it refuses and
        the files hold records, those few records are read to say what is wrong with them first."""
        for where, key in ((files, "data.path"), (eval_files, "data.eval_path")):
            if where and document_bound(where, 1) == 0:
                raise no_text(where, key)
        if eval_files or eval_fraction == 0:
            return
        enough = int(2 / (1 - eval_fraction)) + 2  # (more documents: some are left for training)
        n = document_bound(files, enough)
        if n is None or n >= enough or len(split_documents(n, eval_fraction, seed, path, refuse=False)[0]):
            return
        rec = [f for f in files if is_records(f)]
        if rec:  # fewer than `enough` records: reading them costs nothing (a malformed one is said first)
            n -= document_bound(rec, enough)
            n += sum(1 for *_, end in self.units(rec, "data.path") if end)
        if n == 0:
            raise no_text(files, "data.path")
        split_documents(n, eval_fraction, seed, path)

    def made(self, files, digests, eval_files, eval_digests, eval_fraction, seed, path) -> None:
        data = self.tokenise(files, "data.path", digests)
        if eval_files:
            held = self.tokenise(eval_files, "data.eval_path", eval_digests)
            self.train_docs, self.eval_docs = np.arange(len(data)), np.arange(len(held))
            self.build(data, self.train_docs, held, self.eval_docs, "data.eval_path")
        else:  # the documents of each split (indices into the tokenised files)
            self.train_docs, self.eval_docs = split_documents(len(data), eval_fraction, seed, path)
            self.build(data, self.train_docs, data, self.eval_docs, "data.eval_fraction")

    padded = False

    def check_files(self, files: list[Path], key: str) -> None:
        """Plain text and records both work for text data (subclasses need records)."""

    def fingerprint(self) -> dict | None:
        return getattr(self, "identity", None)  # (None: data=classification without files is random data)

    def tokenizer_for(self, spec: str | None, vocab_size: int, files: list[Path], digests: list[str]) -> TokenizerInfo:
        if spec is None:
            key = cache_key("bpe", vocab_size, self.reader_settings(), content_digest(files, digests))
            info = train_tokenizer(lambda: self.texts(files), vocab_size, key, nothing=no_text(files, "data.path"),
                                   expected=self.expected,
                                   total_bytes=sum(f.stat().st_size for f in files))
            self.identity["tokenizer"] = {"digest": info.digest, "trained": True, "vocab_size": vocab_size}
            return info
        info = load_tokenizer(str(spec))
        path = Path(str(spec)).expanduser().resolve()
        folder = path if path.is_dir() else path.parent  # (its tokenizer_config.json is read too)
        files = [f for f in (path if path.is_file() else folder / "tokenizer.json", folder / "tokenizer_config.json",
                             folder / "chat_template.jinja") if f.is_file()]
        # the tokenisation itself (not the files' bytes): the vocabulary and merges, the specials, the chat template
        self.identity["tokenizer"] = {**identity.part(files, [hash_file(f, "data.tokenizer", False)[0] for f in files]),
                                      "digest": identity.digest_over(
            info.digest, info.eos_id, info.pad_id, info.prefix, info.suffix, info.chat_template)}
        identity.check({"tokenizer": self.identity["tokenizer"]}, self.expected)  # before anything is tokenised with it
        if vocab_size != info.vocab_size:
            raise ConfigError("data.vocab_size", f"data.vocab_size={vocab_size} but the tokenizer at {spec} has "
                              f"{info.vocab_size} tokens", f"set data.vocab_size={info.vocab_size}, the tokenizer's own size")
        if self.eos_ends and info.eos_id is None:
            raise ConfigError("data.tokenizer", f"the tokenizer at {spec} has no end-of-text token to end {self.eos_ends} "
                              "with", "use a tokenizer with an eos_token (tokenizer_config.json), or data.tokenizer=null")
        return info

    def reader_settings(self) -> dict:
        return {"kind": self.kind, "errors": self.errors}

    def texts(self, files: list[Path]) -> Iterator[str]:
        """The text a tokenizer is trained on."""
        for segments, *_ in self.units(files, "data.path"):
            yield "".join(text for text, _ in segments)

    def tokenise(self, files: list[Path], key: str, digests: list[str]) -> Tokenised:
        digest = cache_key(self.reader_settings(), content_digest(files, digests), self.info.digest, self.info.prefix,
                           self.info.suffix, self.info.eos_id, self.info.chat_template)
        total = sum(f.stat().st_size for f in files)

        def fill(writer):
            pending, chars = [], 0
            with progress(total, f"tokenising {files[0].parent.name or files[0]}") as bar:
                for unit in self.units(files, key, bar):
                    pending.append(unit)
                    chars += sum(len(t) for t, _ in unit[0])
                    if chars >= ENCODE_BATCH_CHARS or len(pending) >= 4096:
                        self.write(writer, pending)
                        pending, chars = [], 0
                self.write(writer, pending)
            if writer.documents == 0:
                raise no_text(files, key)

        targets = self.kind in ("instruct", "preference")  # a flag per token: carries loss
        return build_cache(self.kind, digest, self.info.vocab_size, fill, with_target=targets)

    def write(self, writer, units) -> None:
        texts = [text for segments, *_ in units for text, _ in segments]
        encoded = iter(self.info.encode_batch(texts))
        for segments, label, first, end in units:
            ids, target = self.assemble([(next(encoded), loss) for _, loss in segments], first, end)
            writer.add(ids, target, label, end)

    def units(self, files: list[Path], key: str, bar=None):
        raise NotImplementedError

    def assemble(self, segments, first: bool, end: bool):
        raise NotImplementedError

    def build(self, data: Tokenised, train_docs, held: Tokenised, held_docs, eval_key: str) -> None:
        raise NotImplementedError

    def encode(self, text):
        return self.info.encode(text)

    def decode(self, ids):
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else super().decode(ids)


class TextCorpus(FileCorpus):
    """``data=text``: documents (plain text files, or ``field`` of records) tokenised, each
    ended with the end-of-text token, read back to back in windows of ``seq_len + 1`` ids."""

    kind = "text"
    eos_ends = "documents"

    def __init__(self, path: str | list[str] | None, seq_len: Positive[int], tokenizer: str | None = None,
                 vocab_size: Positive[int] = 8192, field: str = "text", eval_path: str | list[str] | None = None,
                 eval_fraction: EvalFraction = 0.05, seed: Seed = 0, errors: Literal["strict", "replace"] = "strict",
                 expected: Expected | None = None):
        self.field = field
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors, expected)

    def reader_settings(self):
        return {**super().reader_settings(), "field": self.field}

    def units(self, files, key, bar=None):
        for f in files:
            if is_records(f):
                for where, record in records(f, self.errors):
                    text = text_field(record, self.field, where, "data.field")
                    if text.strip():
                        yield [(text, True)], None, True, True
                if bar is not None:
                    bar.update(f.stat().st_size)
                continue
            started = False
            for piece in text_pieces(f, self.errors):
                if bar is not None:
                    bar.update(len(piece.encode("utf-8", "replace")))
                if started or piece.strip():
                    yield [(piece, True)], None, not started, False
                    started = True
            if started:
                yield [("", True)], None, False, True

    def assemble(self, segments, first, end):
        ids = (self.info.prefix if first else []) + segments[0][0] + ([self.eos_id] if end else [])
        return ids, None

    def build(self, data, train_docs, held, held_docs, eval_key):
        self.train = TokenWindows(data, train_docs, self.seq_len)
        self.eval = TokenWindows(held, held_docs, self.seq_len)
        for split, key, what in ((self.train, "data.path", "the training split"), (self.eval, eval_key, "the held-out split")):
            if len(split) == 0 and (split is self.train or len(held_docs)):
                raise ConfigError(key, f"{what} holds {split.n_tokens} tokens, too few for one window of "
                                  f"seq_len + 1 = {self.seq_len + 1}", "give more text, or a shorter model.seq_len")


def split_documents(n: int, fraction: float, seed: int, path, refuse: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Documents for training and for the held-out split: a seeded random choice of whole
    documents (none in both), as sorted indices (``refuse=False``: none for training, unrefused)."""
    n_eval = 0 if fraction == 0 else max(1, round(n * fraction))
    if n_eval >= n and not refuse:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if n_eval >= n:
        raise ConfigError("data.eval_fraction", f"{describe_files(path)} holds {n} document(s): none would be left for "
                          f"training after holding out {n_eval}",
                          "give more files or records, data.eval_path=FILE, or data.eval_fraction=0")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def no_text(files, key: str) -> ConfigError:
    return ConfigError(key, f"{describe_files(files)} holds no text (every file or record is empty)",
                       "give files with text in them")


def describe_files(path) -> str:
    if isinstance(path, (list, tuple)) or hasattr(path, "__iter__") and not isinstance(path, str):
        items = [str(p) for p in path]
        return items[0] if len(items) == 1 else f"{items[0]} and {len(items) - 1} more"
    return str(path)
