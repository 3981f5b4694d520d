"""The corpora the data config groups name: random tokens, the standard library's Python source
(the default, no download), and the user's own files: ``TextCorpus`` (data=text),
``InstructCorpus`` (data=instruct), ``ClassificationCorpus`` (data=classification).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Annotated, Iterator, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError
from ..schema import NonNegative, Positive, Range, Seed
from .cache import Tokenised, build as build_cache, cache_key, progress
from .packing import Examples, Packed, PadCollate, Sequences, TokenChunks, TokenWindows
from .readers import content_digest, field, is_records, records, resolve_files, text_field, text_pieces
from .tokenizer import ChatTemplate, TokenizerInfo, load_tokenizer, train_tokenizer

log = logging.getLogger("looplib")


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
    """What a data config builds: a train split, a held-out split, and how to decode tokens.

    ``train``/``eval``: datasets of dict samples with next-token-shifted ``labels`` (-100: no
    loss); ``collate``: the DataLoader's collate function (None: plain stacking); ``tokenizer``
    (a ``tokenizers.Tokenizer`` or None), ``tokenizer_source`` (the model directory it came
    from, or None), ``vocab_size``, ``eos_id``/``pad_id``, ``label_names`` (classification)."""

    train: Dataset
    eval: Dataset
    vocab_size: int
    collate = None
    tokenizer = None
    tokenizer_source: str | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    label_names: list[str] | None = None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def sample_prompt(self) -> str:
        """A short prompt from the held-out data (the end-of-run sample, looplib.generate)."""
        if len(self.eval) == 0:
            return ""
        return self.decode(self.eval[0]["input_ids"][:8].tolist())

    def save(self, run_dir: Path) -> None:
        """Write what a run directory needs to read the model's outputs back (labels.json)."""


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
                 eval_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.05, root: str | None = None,
                 cache_dir: str | None = None):
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

    def sample_prompt(self):
        return "def "


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


EvalFraction = Annotated[float, Range(ge=0, lt=1)]   # 0: no held-out data
ENCODE_BATCH_CHARS = 8 << 20   # text handed to the tokenizer at once (its threads split the batch)


class FileCorpus(Corpus):
    """The user's files: the tokenizer, tokenising once into the cache, the held-out split.

    Subclasses say what a unit of input is (``units``: text pieces and records as
    ``(segments, label, first, end)``, each segment ``(text, carries_loss)``) and how its
    ids are put together (``assemble``)."""

    kind = "text"

    def __init__(self, path, seq_len: int, tokenizer: str | None, vocab_size: int, eval_path, eval_fraction: float,
                 seed: int, errors: str):  # checked by looplib.schema against the subclasses' annotations
        self.seq_len, self.errors, self.seed, self.chat = seq_len, errors, seed, None
        files = resolve_files(path, "data.path")
        eval_files = resolve_files(eval_path, "data.eval_path") if eval_path else []
        self.check_files(files, "data.path")
        self.check_files(eval_files, "data.eval_path")
        self.info = self.tokenizer_for(tokenizer, vocab_size, files)
        self.tokenizer, self.tokenizer_source = self.info.tokenizer, self.info.source
        self.eos_id, self.pad_id = self.info.eos_id, self.info.pad_id
        self.vocab_size = max(vocab_size, self.info.vocab_size)
        data = self.tokenise(files, "data.path")
        if eval_files:
            held = self.tokenise(eval_files, "data.eval_path")
            self.train_docs, self.eval_docs = np.arange(len(data)), np.arange(len(held))
            self.build(data, self.train_docs, held, self.eval_docs, "data.eval_path")
        else:  # the documents of each split (indices into the tokenised files)
            self.train_docs, self.eval_docs = split_documents(len(data), eval_fraction, seed, path)
            self.build(data, self.train_docs, data, self.eval_docs, "data.eval_fraction")
        self.collate = PadCollate(self.pad_id) if self.padded else None

    padded = False

    def check_files(self, files: list[Path], key: str) -> None:
        """Plain text and records both work for text data (subclasses need records)."""

    def tokenizer_for(self, spec: str | None, vocab_size: int, files: list[Path]) -> TokenizerInfo:
        if spec is None:
            key = cache_key("bpe", vocab_size, self.reader_settings(), content_digest(files))
            return train_tokenizer(lambda: self.texts(files), vocab_size, key)
        info = load_tokenizer(str(spec))
        if vocab_size != info.vocab_size:
            raise ConfigError("data.vocab_size", f"data.vocab_size={vocab_size} but the tokenizer at {spec} has "
                              f"{info.vocab_size} tokens", "leave data.vocab_size out: it follows data.tokenizer")
        return info

    def reader_settings(self) -> dict:
        return {"kind": self.kind, "errors": self.errors}

    def texts(self, files: list[Path]) -> Iterator[str]:
        """The text a tokenizer is trained on."""
        for segments, *_ in self.units(files, "data.path"):
            yield "".join(text for text, _ in segments)

    def tokenise(self, files: list[Path], key: str) -> Tokenised:
        digest = cache_key(self.reader_settings(), content_digest(files), self.info.digest, self.info.prefix,
                           self.info.suffix, self.info.eos_id, self.info.chat_template)
        total = sum(f.stat().st_size for f in files)

        def fill(writer):
            pending, chars = [], 0
            with progress(total, files[0].parent.name or str(files[0])) as bar:
                for unit in self.units(files, key, bar):
                    pending.append(unit)
                    chars += sum(len(t) for t, _ in unit[0])
                    if chars >= ENCODE_BATCH_CHARS or len(pending) >= 4096:
                        self.write(writer, pending)
                        pending, chars = [], 0
                self.write(writer, pending)
            if writer.documents == 0:
                raise ConfigError(key, f"{describe(files)} holds no text (every file or record is empty)",
                                  "give files with text in them")

        return build_cache(self.kind, digest, self.info.vocab_size, fill, with_target=self.kind == "instruct")

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

    def __init__(self, path: str | list[str] | None, seq_len: Positive[int], tokenizer: str | None = None,
                 vocab_size: Positive[int] = 8192, field: str = "text", eval_path: str | list[str] | None = None,
                 eval_fraction: EvalFraction = 0.05, seed: Seed = 0, errors: Literal["strict", "replace"] = "strict"):
        self.field = field
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors)

    def reader_settings(self):
        return {**super().reader_settings(), "field": self.field}

    def tokenizer_for(self, spec, vocab_size, files):
        info = super().tokenizer_for(spec, vocab_size, files)
        if info.eos_id is None:
            raise ConfigError("data.tokenizer", f"the tokenizer at {spec} has no end-of-text token to end documents with",
                              "use a tokenizer with an eos_token (tokenizer_config.json), or data.tokenizer=null")
        return info

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


class InstructCorpus(FileCorpus):
    """``data=instruct``: prompt/completion records, or chat ``messages`` rendered with the
    tokenizer's chat template; loss only on the completion (assistant) tokens. One example per
    sample padded per batch, or several per window with ``pack`` (see ``packing.Packed``)."""

    kind = "instruct"
    padded = True

    def __init__(self, path: str | list[str] | None, seq_len: Positive[int], tokenizer: str | None = None,
                 vocab_size: Positive[int] = 8192, prompt_field: str = "prompt", completion_field: str = "completion",
                 messages_field: str = "messages", pack: bool = False, eval_path: str | list[str] | None = None,
                 eval_fraction: EvalFraction = 0.05, seed: Seed = 0, errors: Literal["strict", "replace"] = "strict"):
        self.fields = {"prompt": prompt_field, "completion": completion_field, "messages": messages_field}
        self.pack = pack
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors)

    def check_files(self, files, key):
        plain = [f for f in files if not is_records(f)]
        if plain:
            raise ConfigError(key, f"{plain[0]} is plain text, but instruct data are records",
                              "give JSONL, JSON, CSV or Parquet files with prompt and completion fields")

    def reader_settings(self):
        return {**super().reader_settings(), **self.fields}

    def tokenizer_for(self, spec, vocab_size, files):
        info = super().tokenizer_for(spec, vocab_size, files)
        if info.eos_id is None:
            raise ConfigError("data.tokenizer", f"the tokenizer at {spec} has no end-of-text token to end completions with",
                              "use a tokenizer with an eos_token (tokenizer_config.json), or data.tokenizer=null")
        return info

    def units(self, files, key, bar=None):
        for f in files:
            for where, record in records(f, self.errors):
                if self.fields["messages"] in record:
                    if self.chat is None:  # (no tokenizer yet while one is trained: refused there)
                        self.chat = ChatTemplate(getattr(self, "info", None), "data.messages_field")
                    yield self.chat.segments(record[self.fields["messages"]], where), None, False, True
                    continue
                if self.fields["prompt"] not in record and self.fields["completion"] not in record:
                    present = ", ".join(map(str, record)) or "none"
                    raise ConfigError("data.prompt_field", f"{where} has neither {self.fields['prompt']!r} and "
                                      f"{self.fields['completion']!r} nor {self.fields['messages']!r} (fields: {present})",
                                      "set data.prompt_field and data.completion_field (or data.messages_field)")
                prompt = text_field(record, self.fields["prompt"], where, "data.prompt_field")
                completion = text_field(record, self.fields["completion"], where, "data.completion_field")
                yield [(prompt, False), (completion, True)], None, True, True
            if bar is not None:
                bar.update(f.stat().st_size)

    def assemble(self, segments, first, end):
        """prompt/completion (``first``): [BOS] prompt completion EOS, loss on completion + EOS;
        chat: the rendered conversation as the template writes it (BOS and end-of-turn tokens
        included), loss on the assistant turns."""
        ids, target = [], []
        if first:
            ids, target = list(self.info.prefix), [0] * len(self.info.prefix)
        for seg, loss in segments:
            ids += seg
            target += [int(loss)] * len(seg)
        if first:
            ids.append(self.eos_id)
            target.append(1)
        return ids, target

    def build(self, data, train_docs, held, held_docs, eval_key):
        kind = Packed if self.pack else Examples
        self.train, self.eval = kind(data, train_docs, self.seq_len), kind(held, held_docs, self.seq_len)
        long = int((data.lengths()[train_docs] > self.seq_len + 1).sum())
        if long:
            log.warning("%d of %d training examples are longer than seq_len + 1 = %d tokens: cut to fit",
                        long, len(train_docs), self.seq_len + 1)

    def sample_prompt(self):
        if len(self.eval) == 0:
            return ""
        doc = int(self.eval.docs[0])
        ids, target = self.eval.ids(doc)
        prompt = ids[:int(np.argmax(target)) if target.any() else len(ids)].tolist()
        return self.tokenizer.decode(prompt[len(self.info.prefix):], skip_special_tokens=False)


class ClassificationCorpus(FileCorpus):
    """``data=classification``: ``text_field`` and ``label_field`` of records (labels as names or
    as integers 0..N-1; ``label_names`` fixes the names and their order). Without ``path``: the
    guides' random data (``num_classes`` random labels over random ids of ``seq_len``)."""

    kind = "classification"
    padded = True

    def __init__(self, seq_len: Positive[int], path: str | list[str] | None = None, text_field: str = "text",
                 label_field: str = "label", label_names: list[str] | None = None, tokenizer: str | None = None,
                 vocab_size: Positive[int] = 30522, eval_path: str | list[str] | None = None,
                 eval_fraction: EvalFraction = 0.05, seed: Seed = 0, errors: Literal["strict", "replace"] = "strict",
                 n_train: Positive[int] = 512, n_eval: NonNegative[int] = 64, num_classes: Positive[int] = 2):
        self.fields = {"text": text_field, "label": label_field}
        self.given_names = list(label_names) if label_names else None
        if path is None:  # the guides' experiment, exactly as RandomCorpus builds it
            random = RandomCorpus(seq_len, vocab_size, n_train, n_eval, num_classes, seed)
            self.vocab_size, self.train, self.eval = vocab_size, random.train, random.eval
            self.label_names = [str(i) for i in range(num_classes)]
            self.encode = random.encode
            return
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors)

    check_files = InstructCorpus.check_files

    def reader_settings(self):
        return {**super().reader_settings(), **self.fields}

    def units(self, files, key, bar=None):
        for f in files:
            for where, record in records(f, self.errors):
                text = text_field(record, self.fields["text"], where, "data.text_field")
                label = field(record, self.fields["label"], where, "data.label_field")
                if isinstance(label, (bool, float)) or not isinstance(label, (int, str)):
                    raise ConfigError("data.label_field", f"{where}: label {label!r} is neither a name nor a whole number",
                                      "use class names or integers 0..N-1")
                yield [(text, False)], label, True, True
            if bar is not None:
                bar.update(f.stat().st_size)

    def assemble(self, segments, first, end):
        return self.info.prefix + segments[0][0] + self.info.suffix, None

    def build(self, data, train_docs, held, held_docs, eval_key):
        self.label_names = self.given_names or label_names(data.labels)
        ids = label_ids(data.labels, self.label_names, "data.label_names", "a training")
        held_ids = ids if held is data else label_ids(held.labels, self.label_names, eval_key, "a held-out")
        self.train = Sequences(data, train_docs, ids[train_docs], self.seq_len, self.info.suffix)
        self.eval = Sequences(held, held_docs, held_ids[held_docs], self.seq_len, self.info.suffix)

    def sample_prompt(self):
        return self.decode(self.eval[0]["input_ids"][:8].tolist()) if len(self.eval) else ""

    def save(self, run_dir):
        labels = {"id2label": dict(enumerate(self.label_names)), "label2id": {n: i for i, n in enumerate(self.label_names)}}
        tmp = Path(run_dir) / "labels.json.tmp"
        tmp.write_text(json.dumps(labels, indent=1) + "\n")
        os.replace(tmp, Path(run_dir) / "labels.json")


def is_whole(value) -> bool:
    if isinstance(value, str):
        return re.fullmatch(r"\d+", value.strip()) is not None
    return isinstance(value, int) and not isinstance(value, bool)


def label_names(raw: list) -> list[str]:
    """Integer labels 0..N-1 keep their numbers (names "0".."N-1"); names are sorted."""
    if all(map(is_whole, raw)):
        return [str(i) for i in range(max(int(r) for r in raw) + 1)]
    return sorted({str(r) for r in raw})


def label_ids(raw: list, names: list[str], key: str, what: str) -> np.ndarray:
    """Each label's class id: by name, or an integer label as the id itself."""
    index = {name: i for i, name in enumerate(names)}
    out = np.empty(len(raw), dtype=np.int64)
    for j, r in enumerate(raw):
        i = index.get(str(r).strip())
        if i is None and is_whole(r) and int(r) < len(names):
            i = int(r)
        if i is None:
            raise ConfigError(key, f"label {r!r} of {what} record ({j + 1}) is not among the labels "
                              f"({', '.join(names[:10])})", "use only the training labels (or list them in data.label_names)")
        out[j] = i
    return out


def split_documents(n: int, fraction: float, seed: int, path) -> tuple[np.ndarray, np.ndarray]:
    """Documents for training and for the held-out split: a seeded random choice of whole
    documents (none in both), as sorted indices."""
    n_eval = 0 if fraction == 0 else max(1, round(n * fraction))
    if n_eval >= n:
        raise ConfigError("data.eval_fraction", f"{describe(path)} holds {n} document(s): none would be left for "
                          f"training after holding out {n_eval}",
                          "give more files or records, data.eval_path=FILE, or data.eval_fraction=0")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def describe(path) -> str:
    if isinstance(path, (list, tuple)) or hasattr(path, "__iter__") and not isinstance(path, str):
        items = [str(p) for p in path]
        return items[0] if len(items) == 1 else f"{items[0]} and {len(items) - 1} more"
    return str(path)
