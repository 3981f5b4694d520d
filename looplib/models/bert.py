"""A BERT-style encoder classifier in plain PyTorch (the guides' BERT-large experiment).

BERT-large's shape (24 layers, 16 heads, 1024 wide, 512 positions, 30522-token vocabulary)
gives about 335M parameters, like ``bert-large-uncased``. It reuses looplib's transformer
``Block`` without the causal mask; one deliberate difference from the original: the blocks
are pre-norm (a final LayerNorm is added), which trains more stably and has the same
parameter count per block and the same memory anatomy.
"""
from __future__ import annotations

import torch
from torch import nn

from ..schema import Beta, Positive
from .gpt import Block, check_heads, init_weights, weights_loaded


class BertClassifier(nn.Module):
    """``model(input_ids, attention_mask=None) -> logits`` of shape (batch, num_classes)."""

    def __init__(self, vocab_size: Positive[int] = 30522, seq_len: Positive[int] = 512, n_layer: Positive[int] = 24,
                 n_head: Positive[int] = 16, d_model: Positive[int] = 1024, num_classes: Positive[int] = 2,
                 type_vocab_size: Positive[int] = 2, dropout: Beta = 0.1):
        super().__init__()
        check_heads(d_model, n_head)
        self.seq_len = seq_len
        self.config = dict(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                           d_model=d_model, num_classes=num_classes)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.type_emb = nn.Embedding(type_vocab_size, d_model)
        self.ln_emb = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, causal=False) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.pooler = nn.Linear(d_model, d_model)
        self.classifier = nn.Linear(d_model, num_classes)
        self.apply(init_weights)
        weights_loaded(self)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        x = self.drop(self.ln_emb(self.tok_emb(input_ids) + self.pos_emb(pos) + self.type_emb(types)))
        # padding mask: True where a key may be attended to, broadcast over heads and queries
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        pooled = torch.tanh(self.pooler(self.ln_f(x)[:, 0]))  # the first ([CLS]) position
        return self.classifier(self.drop(pooled))

    def flops_per_sequence(self, seq_len: int | None = None) -> int:
        """Matmul FLOPs of one forward + backward of one sequence: 6 x (weights in matmuls) per
        token for the blocks, 6 x (pooler + classifier) once per sequence, and attention's
        12 x layers x width x seq_len per token (QK^T and AV, forward and backward)."""
        t = seq_len or self.seq_len
        body = sum(m.weight.numel() for b in self.blocks for m in b.modules() if isinstance(m, nn.Linear))
        head = self.pooler.weight.numel() + self.classifier.weight.numel()
        c = self.config
        return 6 * body * t + 6 * head + 12 * c["n_layer"] * c["d_model"] * t * t
