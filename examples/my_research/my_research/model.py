"""A model: a GRU language model. Any nn.Module works; looplib's LM objectives call
``model(batch["input_ids"])`` and expect logits of shape (batch, time, vocab)."""
from __future__ import annotations

from torch import nn

from looplib.models.gpt import GPT


class GRULM(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int = 128, n_layer: int = 2, dropout: float = 0.0):
        super().__init__()
        self.seq_len = seq_len  # data configs read ${model.seq_len}; generate() uses it too
        self.embed = nn.Embedding(vocab_size, d_model)
        self.rnn = nn.GRU(d_model, d_model, num_layers=n_layer, dropout=dropout if n_layer > 1 else 0.0,
                          batch_first=True)
        self.proj = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids):
        hidden, _ = self.rnn(self.embed(input_ids))
        return self.head(self.norm(self.proj(hidden)))

    generate = GPT.generate  # looplib's top-k sampler only calls self(ids): any LM can borrow it
