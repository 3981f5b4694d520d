"""``data=prompts``: prompts to sample completions for (``loss=grpo``), each with the fields a
reward reads.

A record is ``{prompt, ...}``: the prompt as text, or as chat messages (a list of ``{role,
content}``) rendered with the tokenizer's chat template up to the opening of the assistant's
turn. Every other field (the expected ``answer``, test cases, ...) is handed to the reward
untouched, with the record as it was read. Files, formats (JSONL, JSON, CSV, Parquet), the token
cache, the held-out split and the refusals of bad input are those of the other record data
(``looplib.data.files``): one record is one document of the cache, and the records themselves
are read once more when the corpus is built (their fields are not in the token cache).

A sample is one prompt: ``{"prompt_ids", "index"}`` (``index``: the record's place in its
files, which seeds its completions: ``looplib.grpo``); a batch keeps the prompts as a list (they
differ in length: the sampler left-pads them, ``looplib.sampling``).
"""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError
from ..schema import Positive, Seed
from .identity import Expected
from .files import EvalFraction, FileCorpus
from .readers import field, is_records, records, resolve_files, text_field
from .tokenizer import ChatTemplate


class PromptCorpus(FileCorpus):
    """``data=prompts``: one prompt per record, its other fields kept for the reward (the module)."""

    kind = "prompts"
    padded = False
    prompts = True   # what rollout objectives (loss=grpo) ask of their data (looplib.run.rules)

    def __init__(self, path: str | list[str] | None, seq_len: Positive[int], tokenizer: str | None = None,
                 vocab_size: Positive[int] = 8192, prompt_field: str = "prompt",
                 eval_path: str | list[str] | None = None, eval_fraction: EvalFraction = 0.05, seed: Seed = 0,
                 errors: Literal["strict", "replace"] = "strict", expected: Expected | None = None):
        self.prompt_field = prompt_field
        self.eval_files = resolve_files(eval_path, "data.eval_path") if eval_path else []  # their records: build()
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors, expected)
        self.collate = PromptCollate()

    def check_files(self, files, key):
        plain = [f for f in files if not is_records(f)]
        if plain:
            raise ConfigError(key, f"{plain[0]} is plain text, but prompts are records",
                              "give JSONL, JSON, CSV or Parquet files with a prompt field (and what the reward reads)")

    def reader_settings(self):
        return {**super().reader_settings(), "prompt": self.prompt_field}

    def units(self, files, key, bar=None):
        """One unit per record: its prompt as text (chat messages rendered, generation prompt opened)."""
        for f in files:
            for where, record in records(f, self.errors):
                prompt = field(record, self.prompt_field, where, "data.prompt_field")
                yield [(self.prompt_text(record, where), False)], None, not isinstance(prompt, list), True
            if bar is not None:
                bar.update(f.stat().st_size)

    def prompt_text(self, record: dict, where: str) -> str:
        prompt = field(record, self.prompt_field, where, "data.prompt_field")
        if isinstance(prompt, list):
            if self.chat is None:  # (no tokenizer yet while one is trained: refused there)
                self.chat = ChatTemplate(getattr(self, "info", None), "data.prompt_field")
            self.chat.segments(prompt + [{"role": "assistant", "content": ""}], where)  # the messages' shape checked
            return self.chat.render(prompt, generation_prompt=True)
        text = text_field(record, self.prompt_field, where, "data.prompt_field")
        if not text.strip():
            raise ConfigError("data.prompt_field", f"{where}: the prompt is empty",
                              "give every record a prompt (or drop the records without one)")
        return text

    def assemble(self, segments, first, end):
        """[BOS] prompt for text (the template writes its own BOS for chat), no EOS: the model goes on."""
        return (list(self.info.prefix) if first else []) + segments[0][0], None

    def build(self, data, train_docs, held, held_docs, eval_key):
        train_records = self.read_records(self.files)
        eval_records = self.read_records(self.eval_files) if held is not data else train_records
        for recs, tokens in ((train_records, data), (eval_records, held)):
            if len(recs) != len(tokens):
                raise ConfigError("data.path", f"the token cache holds {len(tokens)} prompts, the files "
                                  f"{len(recs)} records", "remove $LOOPLIB_CACHE's prompts-* entries and run again")
        self.train = PromptExamples(data, train_docs, train_records)
        self.eval = PromptExamples(held, held_docs, eval_records)

    def read_records(self, files) -> list[dict]:
        return [record for f in files for _, record in records(f, self.errors)]

    def longest_prompt(self) -> int:
        """Ids in the longest training prompt (a completion must fit after it: looplib.run.rules)."""
        return self.train.longest()

    def sample_prompt(self):
        if len(self.eval) == 0:
            return ""
        return self.tokenizer.decode(self.eval.ids(0)[len(self.info.prefix):].tolist(), skip_special_tokens=False)


class PromptExamples(Dataset):
    """One prompt per sample: its ids and its record's index (the record itself: ``record(i)``)."""

    def __init__(self, data, docs: np.ndarray, recs: list[dict]):
        self.data, self.docs, self.recs = data, docs, recs

    def __len__(self):
        return len(self.docs)

    def ids(self, i: int) -> np.ndarray:
        doc = int(self.docs[i])
        return self.data.tokens.read(int(self.data.offsets[doc]), int(self.data.offsets[doc + 1]))

    def longest(self) -> int:
        return int(self.data.lengths()[self.docs].max()) if len(self.docs) else 0

    def record(self, index: int) -> dict:
        return self.recs[index]

    def __getitem__(self, i):
        return {"prompt_ids": torch.as_tensor(self.ids(i).astype(np.int64)), "index": int(self.docs[i]),
                "records": self.recs[int(self.docs[i])]}


class PromptCollate:
    """Prompts -> one batch: their ids as a list (unpadded), their indices, their records."""

    def __call__(self, rows: list[dict]) -> dict:
        return {"index": torch.tensor([r["index"] for r in rows]), "prompt_ids": [r["prompt_ids"] for r in rows],
                "records": [r["records"] for r in rows]}
