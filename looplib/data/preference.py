"""``data=preference``: pairs of completions of one prompt, the preferred (``chosen``) and the
other (``rejected``), for preference objectives (``loss=dpo``, ``loss=simpo``, ``loss=orpo``).

A record is ``{prompt, chosen, rejected}`` as strings (field names configurable), or chat form:
``chosen`` and ``rejected`` as message lists (the prompt's turns in each, or in a separate
``prompt`` list), rendered with the tokenizer's chat template. Each sequence is the prompt and
one completion; only the completion (the last assistant turn) carries loss.

One pair is one document of the token cache: the chosen sequence then the rejected one, back
to back, its label the chosen sequence's length. So the held-out split is by pair, and a pair
is one sample: a batch of B pairs is 2B sequences, the chosen rows first (``PairCollate``),
and ``count`` of a preference objective is B.

Pairs longer than ``seq_len + 1`` ids are cut when read (``truncation``, counted in the log):
``prompt_start`` (the default) drops the prompt's first tokens (after the tokenizer's BOS) as
far as needed, then the completions' ends; ``completion_end`` drops the completions' ends first
and the prompt's start only where the prompt alone leaves no room for one completion token.
The same prompt tokens are dropped from both sequences of a pair.
"""
from __future__ import annotations

import logging
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError
from ..schema import Positive, Seed
from .identity import Expected
from .cache import Tokenised
from .files import EvalFraction, FileCorpus
from .packing import IGNORE, next_token_example
from .readers import field, records, text_field
from .records import InstructCorpus
from .tokenizer import ChatTemplate

log = logging.getLogger("looplib")
Truncation = Literal["prompt_start", "completion_end"]


class PreferenceCorpus(FileCorpus):
    """``data=preference``: prompt, chosen and rejected completion per record (see the module)."""

    kind = "preference"
    padded = True
    eos_ends = "completions"
    pairs = True   # what preference objectives ask of their data (looplib.run.assembly)

    def __init__(self, path: str | list[str] | None, seq_len: Positive[int], tokenizer: str | None = None,
                 vocab_size: Positive[int] = 8192, prompt_field: str = "prompt", chosen_field: str = "chosen",
                 rejected_field: str = "rejected", truncation: Truncation = "prompt_start",
                 eval_path: str | list[str] | None = None, eval_fraction: EvalFraction = 0.05, seed: Seed = 0,
                 errors: Literal["strict", "replace"] = "strict", expected: Expected | None = None):
        if truncation not in ("prompt_start", "completion_end"):
            raise ConfigError("data.truncation", f"truncation={truncation!r} is not a way to cut a long pair",
                              "use data.truncation=prompt_start or data.truncation=completion_end")
        self.fields = {"prompt": prompt_field, "chosen": chosen_field, "rejected": rejected_field}
        self.truncation = truncation
        super().__init__(path, seq_len, tokenizer, vocab_size, eval_path, eval_fraction, seed, errors, expected)
        self.collate = PairCollate(self.pad_id)

    check_files = InstructCorpus.check_files

    def reader_settings(self):
        return {**super().reader_settings(), **self.fields}

    def units(self, files, key, bar=None):
        """One unit per record: the chosen sequence's segments, then the rejected one's, each
        ``(text, carries_loss)``, and how many of the segments are the chosen sequence's."""
        for f in files:
            for where, record in records(f, self.errors):
                chosen, rejected = (field(record, self.fields[k], where, f"data.{k}_field") for k in ("chosen", "rejected"))
                if isinstance(chosen, list) or isinstance(rejected, list):
                    first, half = self.chat_pair(record, chosen, rejected, where)
                else:
                    prompt = text_field(record, self.fields["prompt"], where, "data.prompt_field")
                    first = [(prompt, False), (text_field(record, self.fields["chosen"], where, "data.chosen_field"),
                                               True)]
                    first += [(prompt, False), (text_field(record, self.fields["rejected"], where,
                                                           "data.rejected_field"), True)]
                    half = 2
                yield first, half, not isinstance(chosen, list), True
            if bar is not None:
                bar.update(f.stat().st_size)

    def chat_pair(self, record, chosen, rejected, where):
        """Chat form: ``prompt`` (a message list, optional) + each completion's messages, rendered;
        loss on the last assistant turn only (earlier ones are the prompt)."""
        if self.chat is None:
            self.chat = ChatTemplate(getattr(self, "info", None), "data.chosen_field")
        prompt = record.get(self.fields["prompt"]) or []
        if not isinstance(prompt, list) or not isinstance(chosen, list) or not isinstance(rejected, list):
            raise ConfigError("data.prompt_field", f"{where}: chat records need {self.fields['chosen']!r}, "
                              f"{self.fields['rejected']!r} (and {self.fields['prompt']!r}, if given) as message lists",
                              "write every field as a message list, or every field as text")
        out = []
        for completion in (chosen, rejected):
            segments = self.chat.segments(prompt + completion, where)
            last = max(i for i, (_, loss) in enumerate(segments) if loss)
            out.append([(text, loss and i == last) for i, (text, loss) in enumerate(segments)])
        return out[0] + out[1], len(out[0])

    def write(self, writer, units) -> None:
        """Each pair as one document: chosen ids then rejected ids; its label the chosen length."""
        texts = [text for segments, *_ in units for text, _ in segments]
        encoded = iter(self.info.encode_batch(texts))
        for segments, half, plain, end in units:
            pieces = [(next(encoded), loss) for _, loss in segments]
            chosen, chosen_target = self.assemble(pieces[:half], plain, end)
            rejected, rejected_target = self.assemble(pieces[half:], plain, end)
            writer.add(chosen + rejected, chosen_target + rejected_target, len(chosen), end)

    assemble = InstructCorpus.assemble

    def build(self, data, train_docs, held, held_docs, eval_key):
        keep = len(self.info.prefix)
        self.train = PairExamples(data, train_docs, self.seq_len, keep, self.truncation)
        self.eval = PairExamples(held, held_docs, self.seq_len, keep, self.truncation)
        long, same = self.train.long_pairs(), self.train.identical_pairs()
        if long:
            log.warning("%d of %d training pairs are longer than seq_len + 1 = %d tokens: cut to fit "
                        "(data.truncation=%s)", long, len(train_docs), self.seq_len + 1, self.truncation)
        if same:
            log.warning("%d of %d training pairs have a chosen completion identical to the rejected one: they "
                        "add nothing to the loss's gradient (DPO: ln 2 each)", same, len(train_docs))

    def sample_prompt(self):
        """The first held-out pair's prompt (its chosen sequence up to the completion)."""
        if len(self.eval) == 0:
            return ""
        ids, target = self.eval.sequences(0)[0]
        prompt = ids[:int(np.argmax(target)) if target.any() else len(ids)].tolist()
        return self.tokenizer.decode(prompt[len(self.info.prefix):], skip_special_tokens=False)


class PairExamples(Dataset):
    """One pair per sample: ``chosen_*`` and ``rejected_*`` inputs and next-token labels, cut to
    ``seq_len + 1`` ids as ``truncation`` says (the module's docstring); ``keep`` ids at the start
    (the tokenizer's BOS) are never cut."""

    def __init__(self, data: Tokenised, docs: np.ndarray, seq_len: int, keep: int = 0,
                 truncation: Truncation = "prompt_start"):
        self.data, self.docs, self.seq_len, self.keep, self.truncation = data, docs, seq_len, keep, truncation
        self.chosen_len = np.asarray(data.labels or [], dtype=np.int64)
        self.reference: np.ndarray | None = None  # [pairs, 2]: loss.reference=precomputed's (looplib.reference)

    def __len__(self):
        return len(self.docs)

    def long_pairs(self) -> int:
        if not len(self.docs):
            return 0
        total, chosen = self.data.lengths()[self.docs], self.chosen_len[self.docs]
        return int((np.maximum(chosen, total - chosen) > self.seq_len + 1).sum())

    def identical_pairs(self) -> int:
        if not len(self.docs):
            return 0
        total, chosen = self.data.lengths()[self.docs], self.chosen_len[self.docs]
        same = 0
        for doc in self.docs[2 * chosen == total]:
            start, n = int(self.data.offsets[doc]), int(self.chosen_len[doc])
            ids = self.data.tokens.read(start, start + 2 * n)
            same += bool(np.array_equal(ids[:n], ids[n:]))
        return same

    def sequences(self, i: int):
        """((chosen ids, target), (rejected ids, target)) of sample ``i``, cut to fit."""
        doc = int(self.docs[i])
        start, stop, n = int(self.data.offsets[doc]), int(self.data.offsets[doc + 1]), int(self.chosen_len[doc])
        ids, target = self.data.tokens.read(start, stop), self.data.target.read(start, stop)
        pair = [(ids[:n], target[:n]), (ids[n:], target[n:])]
        limit = self.seq_len + 1
        if max(len(s) for s, _ in pair) <= limit:
            return pair
        prompts = [int(np.argmax(t)) if t.any() else len(t) for _, t in pair]
        room = max(0, min(prompts) - self.keep)
        if self.truncation == "prompt_start":
            cut = min(room, max(len(s) for s, _ in pair) - limit)
        else:  # completion_end: the prompt only where it leaves no room for one completion token
            cut = min(room, max(0, max(prompts) + 1 - limit))
        k = self.keep
        return [(np.concatenate([s[:k], s[k + cut:]])[:limit], np.concatenate([t[:k], t[k + cut:]])[:limit])
                for s, t in pair]

    def __getitem__(self, i):
        (c, ct), (r, rt) = self.sequences(i)
        chosen, rejected = next_token_example(c, ct), next_token_example(r, rt)
        out = {"chosen_input_ids": chosen["input_ids"], "chosen_labels": chosen["labels"],
               "rejected_input_ids": rejected["input_ids"], "rejected_labels": rejected["labels"]}
        if self.reference is not None:  # the reference's (chosen, rejected) log-probabilities, computed once
            out["reference_logps"] = torch.from_numpy(self.reference[i].copy())
        return out


class PairCollate:
    """B pairs -> one batch of 2B sequences padded on the right: the chosen ones (rows 0..B-1),
    then the rejected ones (B..2B-1); ``chosen`` marks the rows, ``attention_mask`` real tokens."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        ids = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
        labels = [r["chosen_labels"] for r in rows] + [r["rejected_labels"] for r in rows]
        width = max(len(x) for x in ids)
        batch = {"input_ids": torch.full((len(ids), width), self.pad_id, dtype=torch.long),
                 "labels": torch.full((len(ids), width), IGNORE, dtype=torch.long),
                 "attention_mask": torch.zeros((len(ids), width), dtype=torch.long)}
        for i, (x, y) in enumerate(zip(ids, labels)):
            batch["input_ids"][i, :len(x)], batch["labels"][i, :len(y)], batch["attention_mask"][i, :len(x)] = x, y, 1
        batch["chosen"] = torch.arange(len(ids)) < len(rows)
        if all("reference_logps" in r for r in rows):  # in the rows' order: the chosen ones, then the rejected ones
            both = torch.stack([r["reference_logps"] for r in rows])
            batch["reference_logps"] = torch.cat([both[:, 0], both[:, 1]])
        return batch
