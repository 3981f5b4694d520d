"""A GPT-style decoder in plain PyTorch: pre-norm blocks, SDPA causal attention, tied embeddings."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..sampling import Decoding
from ..schema import Beta, Positive


def check_heads(d_model: int, n_head: int) -> None:
    if d_model % n_head:
        raise ConfigError("model.n_head", f"d_model={d_model} does not split into n_head={n_head} heads",
                          "use an n_head that divides d_model, e.g. model.n_head=4")


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, causal: bool):
        super().__init__()
        assert d_model % n_head == 0, "d_model must be a multiple of n_head"
        self.n_head, self.dropout, self.causal = n_head, dropout, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, attn_mask=None, cache: LayerCache | None = None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        if cache is not None:  # decoding (looplib.sampling): the new positions against the cached ones
            return self.proj(cache.attend(q, k, v).transpose(1, 2).reshape(b, t, c))
        # SDPA picks flash / memory-efficient kernels on CUDA when it can
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, dropout, causal)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x, attn_mask=None, cache: LayerCache | None = None):
        x = x + (self.attn(self.ln1(x), attn_mask) if cache is None else self.attn(self.ln1(x), cache=cache))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``model(input_ids) -> logits``; sizes: tiny (default job) and gpt2_small in conf/model/.

    ``model(input_ids, hidden_only=True)`` returns the final hidden states instead (after the
    last norm), for losses that apply ``lm_head`` themselves a chunk at a time
    (``loss=lm_chunked``). ``pad_vocab_to=64`` rounds the embedding / lm_head rows up to a
    multiple of 64 (tensor-core-friendly matmul shapes); the padded rows are never predicted:
    logits are sliced back to ``vocab_size`` columns, so losses, sampling and evaluation see
    the true vocabulary.
    """

    # the default targets of LoRA (+peft=lora; looplib.peft.GPT_LINEARS): attention and MLP linears
    lora_targets = ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")

    def __init__(self, vocab_size: Positive[int], seq_len: Positive[int], n_layer: Positive[int] = 4,
                 n_head: Positive[int] = 4, d_model: Positive[int] = 128, dropout: Beta = 0.0,
                 pad_vocab_to: Positive[int] = 1):
        super().__init__()
        check_heads(d_model, n_head)
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.config = dict(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer,
                           n_head=n_head, d_model=d_model)
        padded = -(-vocab_size // pad_vocab_to) * pad_vocab_to
        if padded != vocab_size:
            self.config["pad_vocab_to"] = pad_vocab_to
        self.tok_emb = nn.Embedding(padded, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, padded, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix, counted once
        weights_loaded(self)
        self.apply(init_weights)
        for block in self.blocks:  # GPT-2's scaled init of the residual projections
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / (2 * n_layer) ** 0.5)

    @property
    def lm_head(self) -> nn.Linear:
        """The output projection (tied to ``tok_emb``); rows past ``vocab_size`` are padding."""
        return self.head

    def forward(self, input_ids: torch.Tensor, hidden_only: bool = False, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            return self.decode(input_ids, cache)
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if hidden_only:
            return x
        logits = self.head(x)
        # padded rows sliced off: a view, the matmul keeps its padded (aligned) shape
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]

    def decoding_cache(self, valid: torch.Tensor) -> KVCache:
        """An empty key/value cache for decoding rows of ``valid``'s shape (``looplib.sampling``)."""
        return KVCache(valid, len(self.blocks))

    def decode(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next token's logits ``(rows, 1, vocab)`` after ``t`` more positions of every row
        (``model(ids, cache=cache)``), reading the cached keys and values of the earlier ones and
        adding theirs: each row at its own positions, attending to its own tokens
        (``looplib.sampling.Decoding``). Through the blocks' ``__call__``, so hooks on them (FSDP's
        gathers) run as in training."""
        t = input_ids.shape[1]
        if cache.length + t > self.seq_len:
            raise ValueError(f"decoding past the model's {self.seq_len} positions")
        cache.step_mask = cache.mask(t)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(cache.positions(t)))
        for block, layer in zip(self.blocks, cache.layers):
            x = block(x, cache=layer)
        cache.length += t
        logits = self.head(self.ln_f(x[:, -1:]))  # the next token's alone (a prefill's others: never read)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]

    def flops_per_sequence(self, seq_len: int | None = None) -> int:
        """Matmul FLOPs of one forward + backward of one sequence: 6 x (weights in matmuls,
        the tied head counted once) per token, plus attention's 12 x layers x width x seq_len
        per token (QK^T and AV, forward and backward; the causal mask's savings are not
        counted, as in the PaLM paper's MFU)."""
        t = seq_len or self.seq_len
        body = sum(m.weight.numel() for b in self.blocks for m in b.modules() if isinstance(m, nn.Linear))
        c = self.config
        return 6 * (body + self.head.weight.numel()) * t + 12 * c["n_layer"] * c["d_model"] * t * t

    @torch.no_grad()  # not inference_mode: torchao's fp8 weights under FSDP2 cannot be inference tensors
    def generate(self, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int = 40, generator: torch.Generator | None = None, stop: int | None = None) -> torch.Tensor:
        """Top-k sampling; ``stop``: a token id (the end of a chat turn) after which a row is done
        (generation ends when every row is; a done row is padded with it)."""
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.seq_len:])[:, -1].float() / temperature
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
            new = torch.multinomial(probs, 1, generator=generator)
            if stop is not None:
                new = new.masked_fill(done[:, None], stop)
                done |= new[:, 0] == stop
            ids = torch.cat([ids, new], dim=1)
            if stop is not None and bool(done.all()):  # a host sync per token: only when asked to stop
                break
        return ids


class KVCache(Decoding):
    """The bundled GPT's decoding cache: each layer's keys and values, ``(rows, heads, total,
    head_dim)``, allocated at the first write in the dtype of the keys (autocast's)."""

    def __init__(self, valid: torch.Tensor, layers: int):
        super().__init__(valid)
        self.layers = [LayerCache(self) for _ in range(layers)]
        self.step_mask = None


class LayerCache:
    def __init__(self, owner: KVCache):
        self.owner, self.keys, self.values = owner, None, None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, end = self.owner.length, self.owner.length + k.shape[2]
        if self.keys is None:
            shape = (k.shape[0], k.shape[1], self.owner.valid.shape[1], k.shape[3])
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        self.keys[:, :, start:end], self.values[:, :, start:end] = k, v
        return F.scaled_dot_product_attention(q, self.keys[:, :, :end], self.values[:, :, :end],
                                              attn_mask=self.owner.step_mask)


def weights_loaded(model: nn.Module) -> None:
    """``model.weights_from``: None while the weights are as initialised (random), else where they
    were loaded from (``looplib.store.init_from``, or "load_state_dict"): LoRA refuses an untrained base."""
    model.weights_from = None
    model.register_load_state_dict_post_hook(mark_loaded)


def mark_loaded(module: nn.Module, _keys) -> None:
    module.weights_from = module.weights_from or "load_state_dict"


def init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
