"""The rows of scripts/peers/spec.py's data files as looplib data (``data=token_file``, a
``looplib.data.Corpus``) and as a plain dataset of dict samples for the other frameworks."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from spec import load_rows


class TokenRows(Dataset):
    """``{"input_ids", "labels"}`` per row (int64 tensors; labels already shifted, -100: no loss)."""

    def __init__(self, path: str):
        self.input_ids, self.labels = load_rows(path)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        return {"input_ids": torch.from_numpy(self.input_ids[i].astype("int64")),
                "labels": torch.from_numpy(self.labels[i].astype("int64"))}


def corpus(path: str, vocab_size: int, seq_len: int):
    """``data=token_file``: the rows as a looplib Corpus (no held-out split: the benchmark only trains)."""
    from looplib.data import Corpus

    class TokenFile(Corpus):
        def __init__(self):
            self.train, self.eval, self.vocab_size = TokenRows(path), TokenRows(path), vocab_size
            if self.train.input_ids.shape[1] != seq_len:
                raise ValueError(f"{path} holds rows of {self.train.input_ids.shape[1]} tokens, not {seq_len}")

        def encode(self, text):
            return [ord(c) % vocab_size for c in text]

    return TokenFile()
