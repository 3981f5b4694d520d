"""A dataset: the bytes of text files, next-byte prediction (vocabulary: the 256 byte values).

looplib's data contract (``looplib.data.Corpus``): ``train`` and ``eval`` are map-style
datasets of dict samples (``{"input_ids", "labels"}`` for the LM objectives); ``encode`` and
``decode`` turn text into ids and back (for the sample printed at the end of a run).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from looplib.data import Corpus, TokenChunks
from looplib.errors import ConfigError


class ByteCorpus(Corpus):
    def __init__(self, seq_len: int, vocab_size: int = 256, root: str | None = None, pattern: str = "*.py",
                 max_bytes: int = 300_000, eval_fraction: float = 0.1):
        if vocab_size < 256:
            raise ConfigError("data.vocab_size", f"bytes need 256 ids (got vocab_size={vocab_size})",
                              "use data.vocab_size=256")
        root = Path(root or Path(sysconfig.get_paths()["stdlib"]) / "json")
        data = b"".join(p.read_bytes() for p in sorted(root.rglob(pattern)))[:max_bytes]
        if len(data) < 4 * seq_len:
            raise ConfigError("data.root", f"{root} holds only {len(data)} bytes of {pattern}",
                              "point data.root at a folder with more text")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        split = int(len(tokens) * (1 - eval_fraction))
        self.vocab_size = vocab_size
        self.train, self.eval = TokenChunks(tokens[:split], seq_len), TokenChunks(tokens[split:], seq_len)

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
