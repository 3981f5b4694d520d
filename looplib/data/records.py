"""Records with fields of their own: ``InstructCorpus`` (``data=instruct``: prompt/completion or
chat messages, loss on the completion only) and ``ClassificationCorpus``
(``data=classification``: text and label fields)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Literal

import numpy as np

from ..atomic import write_atomic
from ..errors import ConfigError
from ..schema import NonNegative, Positive, Seed
from .identity import Expected
from .files import EvalFraction, FileCorpus
from .packing import Examples, Packed, Sequences
from .readers import field, is_records, records, text_field
from .synthetic import RandomCorpus
from .tokenizer import ChatTemplate

log = logging.getLogger("looplib")


class InstructCorpus(FileCorpus):
    """``data=instruct``: prompt/completion records, or chat ``messages`` rendered with the
    tokenizer's chat template; loss only on the completion (assistant) tokens. One example per
    sample padded per batch, or several per window with ``pack`` (see ``packing.Packed``)."""

    kind = "instruct"
    padded = True
    eos_ends = "completions"

    def __init__(self, path: str | list[str] | None, seq_len: Positive[int], tokenizer: str | None = None,
                 vocab_size: Positive[int] = 8192, prompt_field: str = "prompt", completion_field: str = "completion",
                 messages_field: str = "messages", pack: bool = False, eval_path: str | list[str] | None = None,
                 eval_fraction: EvalFraction = 0.05, seed: Seed = 0, errors: Literal["strict", "replace"] = "strict",
                 expected: Expected | None = None):
        self.fields = {"prompt": prompt_field, "completion": completion_field, "messages": messages_field}
        self.pack = pack
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors, expected)

    def check_files(self, files, key):
        plain = [f for f in files if not is_records(f)]
        if plain:
            raise ConfigError(key, f"{plain[0]} is plain text, but instruct data are records",
                              "give JSONL, JSON, CSV or Parquet files with prompt and completion fields")

    def reader_settings(self):
        return {**super().reader_settings(), **self.fields}

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

    @property
    def chat_records(self) -> bool:
        """Chat messages, not prompt/completion records (the first training record says)."""
        if getattr(self, "_chat_records", None) is None:
            first = next((record for f in self.files[:1] for _, record in records(f, self.errors)), {})
            self._chat_records = self.fields["messages"] in first
        return self._chat_records

    def chat_prompt(self, text: str) -> str:
        if not self.chat_records:
            return text
        if self.chat is None:
            self.chat = ChatTemplate(self.info, "data.messages_field")
        return self.chat.render([{"role": "user", "content": text}], generation_prompt=True)

    def sample_prompt(self):
        """The first held-out example up to its completion: for chat records the conversation as the
        template renders it, up to and including the opening of the assistant's turn."""
        if len(self.eval) == 0:
            return ""
        doc = int(self.eval.docs[0])
        ids, target = self.eval.ids(doc)
        prompt = ids[:int(np.argmax(target)) if target.any() else len(ids)].tolist()
        skip = 0 if self.chat_records else len(self.info.prefix)  # the template writes its own BOS
        return self.tokenizer.decode(prompt[skip:], skip_special_tokens=False)


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
                 n_train: Positive[int] = 512, n_eval: NonNegative[int] = 64, num_classes: Positive[int] = 2,
                 expected: Expected | None = None):
        self.fields = {"text": text_field, "label": label_field}
        self.given_names = list(label_names) if label_names else None
        if path is None:  # the guides' experiment, exactly as RandomCorpus builds it
            random = RandomCorpus(seq_len, vocab_size, n_train, n_eval, num_classes, seed)
            self.vocab_size, self.train, self.eval = vocab_size, random.train, random.eval
            self.label_names = [str(i) for i in range(num_classes)]
            self.encode = random.encode
            return
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors, expected)

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
        write_atomic(Path(run_dir) / "labels.json", json.dumps(labels, indent=1) + "\n")


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
