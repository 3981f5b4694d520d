"""Sampling completions of many prompts at once with a key/value cache (``loss=grpo``'s rollouts).

``sample_groups(model, prompts, n, ...)`` samples ``n`` completions of each prompt: the prompts are
left-padded into one batch of ``len(prompts) x n`` rows, the model reads them once (prefill), then
one token per row per step, each step reading only the new tokens and the cached keys and values
of the earlier ones. Every row keeps its own positions (its first token is position 0, whatever
its padding) and attends to its own tokens only, so a row computes what the prompt alone would.

The random draws are per prompt: the ``n`` rows of prompt ``i`` are drawn with ``generators[i]``
from their batched probabilities (``torch.multinomial`` on that group's rows), exactly as
``sample`` (the uncached reference: whole sequences each token, one prompt at a time) draws them.
A prompt's completions are then the same whichever prompts share its batch, up to the float
rounding of a differently shaped batch (it moves a draw only where the rounding moves a
probability across the drawn uniform: the tests find none at fp32 on the CPU); a resumed run, with
the same micro-batch, samples the same batches and so the same completions bit for bit.

A model that decodes incrementally declares it (the bundled GPT, the transformers ``CausalLM``):

    cache = model.decoding_cache(valid)    # valid: (rows, total) bool, False on the left padding
    logits = model(ids, cache=cache)       # ids: the next t positions of every row -> (rows, t', vocab)
                                           # logits whose last position's are the next token's (t' >= 1)

and ``cache.length`` grows by ``t`` each call (``Decoding`` is what the caches share). A model
without ``decoding_cache`` (a module of one's own) is sampled one prompt at a time with ``sample``.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


class Decoding:
    """What every model's decoding cache holds: ``valid`` (rows, total) marks the positions that
    hold tokens (left padding: False), ``length`` the positions read so far; each row's positions
    count its own tokens only (``positions``), and ``mask(t)`` says which cached positions the next
    ``t`` may attend to: the earlier tokens of their own row, and themselves (a padding position
    attends to itself alone: no row of the attention is empty)."""

    def __init__(self, valid: torch.Tensor):
        self.valid, self.length = valid.bool(), 0
        self.all_positions = (self.valid.long().cumsum(1) - 1).clamp(min=0)

    def positions(self, t: int) -> torch.Tensor:
        return self.all_positions[:, self.length:self.length + t]

    def mask(self, t: int) -> torch.Tensor:
        """(rows, 1, t, length + t) bool, True where a query may attend to a key."""
        end = self.length + t
        keys = torch.arange(end, device=self.valid.device)
        queries = keys[self.length:, None]
        return ((keys <= queries) & (self.valid[:, None, :end] | (keys == queries)))[:, None]


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` kept on the smallest set of most likely tokens whose mass reaches ``top_p``, renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # (the most likely token always)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return kept / kept.sum(-1, keepdim=True)


def draw(logits: torch.Tensor, n: int, temperature: float, top_p: float,
         generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, ``(rows, 1)``: rows ``i*n .. i*n+n-1`` drawn with ``generators[i]`` from
    softmax(logits / temperature) (``top_p`` < 1: its nucleus); ``temperature=0``: the most likely token."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        probs = nucleus(probs, top_p)
    if len(generators) == 1:
        return torch.multinomial(probs, 1, generator=generators[0])
    return torch.cat([torch.multinomial(probs[i * n:(i + 1) * n], 1, generator=g) for i, g in enumerate(generators)])


def sample(model, prompt: torch.Tensor, n: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
           stop: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` completions of one prompt (1-D ids), ``(n, new)``, the model called on whole sequences
    each token (no cache): the reference ``sample_groups`` is held to, and the sampler of a model
    without ``decoding_cache``. A row that sampled ``stop`` is padded with it."""
    ids = prompt[None].expand(n, -1)
    done = torch.zeros(n, dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        new = draw(model(ids)[:, -1], n, temperature, top_p, [generator])
        if stop is not None:
            new = new.masked_fill(done[:, None], stop)
            done |= new[:, 0] == stop
        ids = torch.cat([ids, new], dim=1)
        if stop is not None and bool(done.all()):
            break
    return ids[:, len(prompt):]


def sample_groups(model, prompts: list[torch.Tensor], n: int, max_new_tokens: int, temperature: float = 1.0,
                  top_p: float = 1.0, stop: int | None = None, generators: list[torch.Generator | None] | None = None,
                  pad: int = 0, finished: Callable[[torch.Tensor], bool] | None = None) -> list[torch.Tensor]:
    """``n`` completions of each of ``prompts`` (1-D ids), one ``(n, new)`` tensor per prompt, all
    sampled together with the model's cache (the module's docstring); ``generators[i]`` draws prompt
    ``i``'s rows. A row that sampled ``stop`` is padded with it; sampling ends when ``finished(done)``
    (default: every row is done; several processes whose forwards must stay in step pass a check
    that agrees across them). One host sync per token, for that check (none without ``stop``)."""
    generators = generators if generators is not None else [None] * len(prompts)
    if not hasattr(model, "decoding_cache"):  # a model of one's own: one prompt at a time, uncached
        return [sample(model, p, n, max_new_tokens, temperature, top_p, stop, g) for p, g in zip(prompts, generators)]
    device, width = prompts[0].device, max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    valid = torch.ones((len(prompts), width + max_new_tokens - 1), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        valid[i, :width - len(p)] = False
    ids, valid = ids.repeat_interleave(n, 0), valid.repeat_interleave(n, 0)
    finished = finished or (lambda d: bool(d.all()))
    cache = model.decoding_cache(valid)
    done = torch.zeros(len(ids), dtype=torch.bool, device=device)
    out = []
    with eager():
        logits = model(ids, cache=cache)[:, -1]
        for step in range(max_new_tokens):
            new = draw(logits, n, temperature, top_p, generators)
            if stop is not None:
                new = new.masked_fill(done[:, None], stop)
                done |= new[:, 0] == stop
            out.append(new)
            if step + 1 == max_new_tokens or (stop is not None and finished(done)):
                break
            logits = model(new, cache=cache)[:, -1]
    return list(torch.cat(out, 1).view(len(prompts), n, -1).unbind(0))


def eager():
    """A compiled model (``+compile``) runs eagerly while sampling: its graphs are the training
    forward's, and each decoding step's shapes would compile another."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
