"""Seeded random token ids (``data=random``): for smoke tests, benchmarks and golden losses,
identical everywhere; nothing to learn."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ..schema import NonNegative, Positive, Seed
from .corpus import Corpus


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


class RandomCorpus(Corpus):
    """Random tokens for both splits (tests, benchmarks, the BERT-sized classifier)."""

    def __init__(self, seq_len: Positive[int], vocab_size: Positive[int], n_train: Positive[int] = 512,
                 n_eval: NonNegative[int] = 64, num_classes: NonNegative[int] = 0, seed: Seed = 0):
        self.vocab_size = vocab_size
        self.train = RandomTokens(n_train, seq_len, vocab_size, seed, num_classes)
        self.eval = RandomTokens(n_eval, seq_len, vocab_size, (seed + 1) % 2**64, num_classes)

    def encode(self, text):
        return [ord(c) % self.vocab_size for c in text]
