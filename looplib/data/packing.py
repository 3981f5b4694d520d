"""From token ids to training samples: next-token labels (built here and nowhere else), fixed
windows of a token stream, one example per sample or several packed into one, and the
collate function that pads a batch to its longest sample.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .cache import Tokenised

IGNORE = -100  # a label that carries no loss (prompt tokens, padding)


def next_token_example(ids, target=None) -> dict:
    """``input_ids = ids[:-1]`` and ``labels[t] = ids[t+1]``, or ``IGNORE`` where token t+1 is not
    a target (``target``: one flag per id; None: every token is). The one place labels are made."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    labels = ids[1:].clone()
    if target is not None:
        labels[~torch.as_tensor(np.asarray(target[1:], dtype=bool))] = IGNORE
    return {"input_ids": ids[:-1], "labels": labels}


def shift_labels(sample: dict, ignore_index: int = IGNORE) -> dict:
    """A sample in the Hugging Face convention (``labels`` = ``input_ids`` with the prompt and
    padding masked to ``ignore_index``, shifted inside the model) made looplib's: ``labels[t] =
    labels[t+1]``, ``ignore_index`` last (the last token has no next one); the rest unchanged."""
    labels = torch.as_tensor(sample["labels"])
    shifted = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], ignore_index)], dim=-1)
    return {**sample, "labels": shifted}


class TokenChunks(Dataset):
    """Consecutive, non-overlapping windows of an in-memory token tensor: inputs and next-token labels."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i):
        chunk = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` ids (overlapping by one, so every id is a label once) over the
    documents ``docs`` of a token cache, read back to back from the memory map: documents end
    with the end-of-text token and a window may span several."""

    def __init__(self, data: Tokenised, docs: np.ndarray, seq_len: int):
        starts, stops = data.offsets[docs], data.offsets[docs + 1]
        keep = np.ones(len(docs), bool)   # merge documents that follow each other in the file
        keep[1:] = starts[1:] != stops[:-1]
        self.starts = starts[keep]
        run_stops = np.append(stops[np.flatnonzero(keep)[1:] - 1], stops[-1]) if len(docs) else stops
        self.cum = np.concatenate([[0], np.cumsum(run_stops - self.starts)])
        self.tokens, self.seq_len = data.tokens, seq_len

    @property
    def n_tokens(self) -> int:
        return int(self.cum[-1])

    def __len__(self):
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def __getitem__(self, i):
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len + 1
        j = int(np.searchsorted(self.cum, lo, side="right")) - 1
        pieces = []
        while lo < hi:
            take = min(hi, int(self.cum[j + 1])) - lo
            start = int(self.starts[j]) + lo - int(self.cum[j])
            pieces.append(self.tokens.read(start, start + take))
            lo, j = lo + take, j + 1
        return next_token_example(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])


class Examples(Dataset):
    """One instruct example per sample, cut to ``seq_len + 1`` ids; labels only on target tokens."""

    def __init__(self, data: Tokenised, docs: np.ndarray, seq_len: int):
        self.data, self.docs, self.seq_len = data, docs, seq_len

    def __len__(self):
        return len(self.docs)

    def ids(self, doc: int):
        start = int(self.data.offsets[doc])
        stop = min(int(self.data.offsets[doc + 1]), start + self.seq_len + 1)
        return self.data.tokens.read(start, stop), self.data.target.read(start, stop)

    def __getitem__(self, i):
        return next_token_example(*self.ids(int(self.docs[i])))


class Packed(Examples):
    """Several examples per sample, in order, up to ``seq_len`` input tokens each: labels never
    cross from one example into the next, and ``position_ids`` restart at 0 for each, which is
    how transformers (>= 4.54, sdpa and eager alike) keeps packed examples from attending to
    one another: with position_ids and no attention_mask it builds a block-diagonal causal mask."""

    def __init__(self, data: Tokenised, docs: np.ndarray, seq_len: int):
        super().__init__(data, docs, seq_len)
        sizes = np.minimum(data.lengths()[docs], seq_len + 1) - 1   # input tokens each example gives
        self.bins, used = [0], 0
        for i, n in enumerate(sizes.tolist()):
            if used + n > seq_len and i > self.bins[-1]:
                self.bins.append(i)
                used = 0
            used += n
        self.bins.append(len(docs))

    def __len__(self):
        return len(self.bins) - 1 if len(self.docs) else 0

    def __getitem__(self, i):
        parts = [next_token_example(*self.ids(int(d))) for d in self.docs[self.bins[i]:self.bins[i + 1]]]
        return {"input_ids": torch.cat([p["input_ids"] for p in parts]),
                "labels": torch.cat([p["labels"] for p in parts]),
                "position_ids": torch.cat([torch.arange(len(p["input_ids"])) for p in parts])}


class Sequences(Dataset):
    """Classification: one text per sample, cut to ``seq_len`` ids (keeping the tokenizer's
    closing special tokens, e.g. [SEP]), and its class id."""

    def __init__(self, data: Tokenised, docs: np.ndarray, label_ids: np.ndarray, seq_len: int, suffix: list[int]):
        self.data, self.docs, self.label_ids, self.seq_len = data, docs, label_ids, seq_len
        self.suffix = np.asarray(suffix, dtype=np.int64)

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        doc = int(self.docs[i])
        start, stop = int(self.data.offsets[doc]), int(self.data.offsets[doc + 1])
        ids = self.data.tokens.read(start, stop).astype(np.int64)
        if len(ids) > self.seq_len:
            ids = np.concatenate([ids[:self.seq_len - len(self.suffix)], self.suffix])
        return {"input_ids": torch.from_numpy(ids), "labels": torch.tensor(int(self.label_ids[i]))}


class PadCollate:
    """Stacks samples of different lengths, padded on the right to the longest in the batch:
    ``input_ids`` with ``pad_id``, sequence ``labels`` with ``IGNORE``. Unpacked batches get an
    ``attention_mask`` (1 on real tokens); packed ones (with ``position_ids``) get none (see
    ``Packed``), their padding is one more short sequence that carries no loss."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        lengths = [len(r["input_ids"]) for r in rows]
        width = max(lengths)

        def pad(key, value):
            out = torch.full((len(rows), width), value, dtype=torch.long)
            for i, r in enumerate(rows):
                out[i, :lengths[i]] = r[key]
            return out

        batch = {"input_ids": pad("input_ids", self.pad_id)}
        labels = [r["labels"] for r in rows]
        batch["labels"] = torch.stack(labels) if labels[0].dim() == 0 else pad("labels", IGNORE)
        if "position_ids" in rows[0]:
            positions = pad("position_ids", 0)
            for i, n in enumerate(lengths):
                positions[i, n:] = torch.arange(width - n)
            batch["position_ids"] = positions
        else:
            batch["attention_mask"] = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return batch
