"""Knowledge distillation (``loss=distill``): the student (the model being trained) learns the
labels' next tokens and the teacher's distribution over the vocabulary at the same positions.

Per loss-bearing token (label not ``ignore_index``: prompt and padding tokens carry neither term)

    loss = (1 - alpha) * CE(student logits, label) + alpha * T^2 * D(teacher, student at T)

with T the temperature (both distributions softened as softmax(logits / T); the T^2 keeps the
distillation term's gradients the size of the cross-entropy's as T grows) and D one of

    forward_kl   KL(q || p) = sum q (log q - log p)       (the teacher's mass covered: the usual choice)
    reverse_kl   KL(p || q) = sum p (log p - log q)       (the student's mass where the teacher's is: mode-seeking)
    jsd          beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q   (beta 0.5: Jensen-Shannon)

p the student's and q the teacher's softened distribution. The loss is **summed over the
tokens** and ``count`` is the tokens, as ``loss=lm``'s: accumulation and process count leave the
update unchanged.

Neither model's logits exist whole: both models return their final hidden states
(``hidden_only=True``, as for ``loss=lm_chunked``) and their output projections are applied
``chunk_size`` tokens at a time; each chunk's two logit blocks are made, turned into the chunk's
loss and its gradients with respect to the student's hidden states and head, and dropped (memory:
a few chunk x vocab blocks instead of two tokens x vocab tensors and their copies for backward).

The teacher (``teacher=PATH``): a transformers model directory (``save_pretrained``'s), or a
finished looplib run, read by the run (``looplib.run.teacher``); or, from Python, a module. It is
frozen (no gradients, eval mode: no dropout), optionally cast (``teacher_dtype``), and placed on
the student's device by ``attach(model, engine)``, which looplib's runs call once the model is on
its device. It must have the student's vocabulary.
"""
from __future__ import annotations

import hashlib
import logging
import math
from typing import Literal

import torch
from torch import nn

from .errors import ConfigError
from .loss import TokenCrossEntropy, output_head
from .schema import Fraction, Positive

log = logging.getLogger("looplib")
KEY = "loss.teacher"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENS = ("data.tokenizer=TEACHER_DIR (a transformers directory) or the teacher run's "
          "checkpoints/step-N/tokenizer.json, or the teacher run's own data settings")


class Distill(TokenCrossEntropy):
    """``loss=distill`` (the module's docstring). ``train_metrics``/``eval_metrics``: the mean
    cross-entropy (``loss_ce``) and distillation term D (``loss_distill``, without alpha and T^2)
    per token since the last row, over every rank."""

    def __init__(self, teacher: str | nn.Module | None = None, temperature: Positive[float] = 1.0,
                 alpha: Fraction = 0.5, kind: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl",
                 beta: Fraction = 0.5, teacher_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
                 chunk_size: Positive[int] = 1024, ignore_index: int = -100):
        super().__init__(ignore_index)
        if kind not in ("forward_kl", "reverse_kl", "jsd"):
            raise ConfigError("loss.kind", f"kind={kind!r} is not a divergence looplib has",
                              "use loss.kind=forward_kl, reverse_kl or jsd")
        if kind == "jsd" and not 0 < beta < 1:
            raise ConfigError("loss.beta", f"beta={beta} leaves one distribution out of the mixture",
                              "use 0 < loss.beta < 1 (0.5: Jensen-Shannon), or loss.kind=forward_kl / reverse_kl")
        if not temperature > 0 or chunk_size < 1 or teacher_dtype not in DTYPES:
            raise ConfigError("loss", f"temperature={temperature}, chunk_size={chunk_size}, teacher_dtype="
                              f"{teacher_dtype!r}: the temperature must be positive, chunk_size at least 1, the dtype "
                              f"one of {', '.join(DTYPES)}", "use e.g. loss.temperature=2 loss.chunk_size=1024")
        self.temperature, self.alpha, self.kind, self.beta = temperature, alpha, kind, beta
        self.dtype, self.chunk_size = DTYPES[teacher_dtype], chunk_size
        self.path = None if isinstance(teacher, nn.Module) else teacher
        self.teacher: nn.Module | None = None
        self.digest: str | None = None
        if isinstance(teacher, nn.Module):
            self.take(teacher)
        self.tallies = {True: None, False: None}   # training / evaluation sums (device tensors: no sync)

    # ------------------------------------------------------------------ the teacher
    @property
    def unread(self) -> str | None:
        """The teacher's directory while it is not read yet (``looplib.run.teacher`` reads it)."""
        return self.path if self.teacher is None else None

    def take(self, teacher: nn.Module) -> None:
        """The teacher: frozen (no gradients), in eval mode (no dropout), cast to ``teacher_dtype``."""
        self.teacher = teacher.to(self.dtype).requires_grad_(False).eval()
        self.digest = weights_digest(self.teacher)

    def fingerprint(self) -> dict | None:
        """What identifies the teacher (a digest of its weights as cast): kept in every checkpoint
        beside the data's, so that a resume refuses a teacher changed since (``looplib.data.identity``)."""
        return {"digest": self.digest} if self.digest is not None else None

    def held(self) -> nn.Module:
        if self.teacher is None:
            raise ConfigError(KEY, f"the teacher at {self.path} is not read" if self.path else
                              "loss=distill has no teacher", "give loss.teacher=DIR (a transformers model directory "
                              "or a finished looplib run); in a loop of your own, Distill(teacher=MODULE), e.g. "
                              "looplib.run.teacher.load_teacher(DIR)")
        return self.teacher

    def check_data(self, corpus, model: nn.Module, engine=None) -> None:
        """Before anything is set up (``looplib.run.assembly.build``): an engine that shards the
        student, a teacher of another vocabulary, sequences longer than the teacher's positions."""
        refuse_sharding(engine)
        teacher = self.held()
        same_vocabulary(teacher, model, self.path)
        limit = positions(teacher)
        try:
            length = corpus.train[0]["input_ids"].shape[-1] if len(corpus.train) else 0
        except (AttributeError, IndexError, KeyError, TypeError):
            return
        if limit is not None and length > limit:
            raise ConfigError(KEY, f"the data's sequences hold {length} tokens, more than the teacher's {limit} "
                              f"positions ({self.path or type(teacher).__name__})",
                              f"use data.seq_len={limit} or less (model.seq_len)")

    def attach(self, model: nn.Module, engine=None) -> None:
        """Place the teacher where the student is (``engine.device``; the student's device without
        an engine), checked against it; looplib's runs call it once the student is set up."""
        refuse_sharding(engine)
        teacher = self.held()
        same_vocabulary(teacher, model, self.path)
        device = engine.device if engine is not None else next(model.parameters()).device
        if engine is not None and not getattr(engine, "keeps_modules", True):  # FSDP2: sharded as the student,
            self.teacher = engine.place_frozen(teacher, cast=False)  # its loss.teacher_dtype kept
        else:
            self.teacher = teacher.to(device)
        size = sum(t.numel() * t.element_size() for t in self.teacher.state_dict().values())
        log.info("distillation teacher: %s, frozen, %s, on %s (%.1f MB)", self.path or type(teacher).__name__,
                 str(self.dtype).split(".")[-1], device, size / 2**20)

    # ------------------------------------------------------------------ the loss
    def __call__(self, model, batch) -> torch.Tensor:
        if self.teacher is None:
            raise ConfigError("loss", "loss=distill's teacher is not placed: attach(model, engine) was not called",
                              "call objective.attach(model) before training (looplib's runs do it)")
        training = torch.is_grad_enabled()  # (autograd runs the Function's forward with grad mode off)
        with torch.no_grad():
            taught = self.teacher(batch["input_ids"], hidden_only=True, **self.inputs(self.teacher, batch))
        hidden = model(batch["input_ids"], hidden_only=True, **self.inputs(model, batch))
        head, vocab = output_head(model)
        with torch.no_grad():  # (a sharded teacher's head: gathered whole, without gradients)
            theirs, _ = output_head(self.teacher)
        total, ce, kd = LinearDistill.apply(
            hidden.flatten(0, -2), head.weight, head.bias, taught.flatten(0, -2), theirs.weight, theirs.bias,
            batch["labels"].flatten(), (vocab, self.ignore_index, self.chunk_size, self.kind, self.temperature,
                                        self.alpha, self.beta),
            tuple(training and t is not None and t.requires_grad for t in (hidden, head.weight, head.bias)))
        sums = torch.stack([ce, kd, (batch["labels"] != self.ignore_index).sum().to(ce)]).double()
        self.tallies[training] = sums if self.tallies[training] is None else self.tallies[training] + sums
        return total

    def metrics(self, training: bool, reduce=None, prefix: str = "") -> dict:
        sums, self.tallies[training] = self.tallies[training], None
        if sums is None:
            return {}
        if reduce is not None:
            sums = reduce(sums)
        ce, kd, n = sums.tolist()
        return {prefix + "loss_ce": ce / max(n, 1.0), prefix + "loss_distill": kd / max(n, 1.0)}

    def train_metrics(self, reduce=None) -> dict:
        """The two terms per token since the last logging step (then reset); ``reduce`` sums across ranks."""
        return self.metrics(True, reduce)

    def eval_metrics(self, reduce=None) -> dict:
        return self.metrics(False, reduce, "eval_")


def refuse_sharding(engine) -> None:
    """An engine that shards the student and cannot place the teacher beside it (ZeRO-3: the chunked
    loss reads the student's whole head outside its forward): refused. FSDP2 shards both."""
    if engine is not None and not getattr(engine, "keeps_modules", True) \
            and not callable(getattr(engine, "place_frozen", None)):
        raise ConfigError("loss", f"loss=distill keeps a teacher beside the student, and +engine="
                          f"{getattr(engine, 'label', type(engine).__name__)} shards the student's weights, which "
                          "the chunked distillation loss does not read yet", "use the local, DDP or FSDP engine")


def same_vocabulary(teacher: nn.Module, model: nn.Module, path) -> None:
    who = f"the teacher at {path}" if path else f"the teacher ({type(teacher).__name__})"
    try:
        _, theirs = output_head(teacher)
    except ConfigError as err:
        raise ConfigError(KEY, f"{who} has no output projection ({err.problem})",
                          "give a causal language model (a transformers *ForCausalLM directory or a looplib LM run)")
    _, ours = output_head(model)
    if theirs != ours:
        raise ConfigError(KEY, f"{who} has a vocabulary of {theirs} tokens, the student {ours}: "
                          "their distributions cannot be compared", f"tokenise the data as the teacher did: {TOKENS}, "
                          f"and data.vocab_size={theirs}")


def weights_digest(module: nn.Module) -> str:
    """sha256 over every tensor of ``module``'s state (names, dtypes, shapes and bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def positions(teacher: nn.Module) -> int | None:
    """How many positions the teacher embeds (None: it does not say)."""
    hf = getattr(teacher, "hf", None)
    if hf is not None:
        from .hf.config import model_positions
        return model_positions(hf.config)
    return getattr(teacher, "seq_len", None)


class LinearDistill(torch.autograd.Function):
    """(the summed loss, the summed cross-entropy, the summed divergence) from the student's hidden
    states and head and the teacher's, ``chunk_size`` rows at a time. As ``looplib.loss``'s
    ``LinearCrossEntropy``: the student's gradients are made in forward, chunk by chunk, so no
    chunk's logits outlive it; backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, taught, t_weight, t_bias, labels, settings, wanted):
        vocab, ignore_index, chunk_size, kind, temperature, alpha, beta = settings
        kind_of = hidden.device.type  # under autocast the matmuls run in its dtype, as nn.Linear's would
        low = torch.get_autocast_dtype(kind_of) if torch.amp.is_autocast_available(kind_of) and \
            torch.is_autocast_enabled(kind_of) else None
        compute, t_compute = low or hidden.dtype, low or taught.dtype
        acc = torch.promote_types(compute, torch.float32)  # softmax and sums: fp32 at least
        w, tw = weight.to(compute), t_weight.to(t_compute)
        ce_total = torch.zeros((), dtype=acc, device=hidden.device)
        kd_total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if wanted[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if wanted[2] else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start:start + chunk_size].to(compute), labels[start:start + chunk_size]
            z = logits_of(h, w, bias, compute, vocab, acc)
            with torch.no_grad():
                zt = logits_of(taught[start:start + chunk_size].to(t_compute), tw, t_bias, t_compute, vocab, acc)
            keep = y != ignore_index
            target = torch.where(keep, y, 0)
            logp = torch.log_softmax(z, dim=-1)
            ce_total += -(logp.gather(1, target[:, None]).squeeze(1) * keep).sum()
            divergence, grad_u = soft_terms(z, zt, kind, temperature, beta, any(wanted))
            kd_total += (divergence * keep).sum()
            del zt
            if not any(wanted):
                continue
            # d loss / d z: (1 - alpha) (softmax(z) - onehot) + alpha T^2 (d D / d u) / T, u = z / T
            g = logp.exp_().mul_(1 - alpha)
            g.scatter_add_(1, target[:, None], torch.full_like(g[:, :1], -(1 - alpha)))
            g.add_(grad_u, alpha=alpha * temperature).mul_(keep[:, None])
            if vocab != weight.shape[0]:
                g = nn.functional.pad(g, (0, weight.shape[0] - vocab))  # padded vocabulary rows: zero gradient
            gc = g.to(compute)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk_size] = torch.mm(gc, w)
            if grad_weight is not None:
                grad_weight += torch.mm(gc.t(), h)
            if grad_bias is not None:
                grad_bias += g.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes, ctx.done = (weight.dtype, None if bias is None else bias.dtype), False
        ctx.mark_non_differentiable(ce_total, kd_total)
        scale = alpha * temperature ** 2
        return (1 - alpha) * ce_total + scale * kd_total, ce_total, kd_total

    @staticmethod
    def backward(ctx, grad_output, _ce, _kd):
        if ctx.done:
            raise RuntimeError("a chunked loss can be backpropagated once (its gradients are scaled in place)")
        ctx.done = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors

        def scale(g, dtype):
            return None if g is None else g.mul_(grad_output).to(dtype)
        hidden_dtype = None if grad_hidden is None else grad_hidden.dtype
        return (scale(grad_hidden, hidden_dtype), scale(grad_weight, ctx.dtypes[0]), scale(grad_bias, ctx.dtypes[1]),
                None, None, None, None, None, None)


def logits_of(h, w, bias, compute, vocab, acc):
    z = torch.mm(h, w.t())
    if bias is not None:
        z = z + bias.to(compute)
    return z[:, :vocab].to(acc)


def soft_terms(z, zt, kind: str, temperature: float, beta: float, grad: bool):
    """Per row: the divergence D between the teacher's and the student's softened distributions,
    and (``grad``) its gradient with respect to the student's softened logits u = z / T."""
    logp = torch.log_softmax(z / temperature, dim=-1)
    logq = torch.log_softmax(zt / temperature, dim=-1)
    p = logp.exp()
    if kind == "forward_kl":
        q = logq.exp()
        return (q * (logq - logp)).sum(-1), (p - q if grad else None)
    if kind == "reverse_kl":
        a = logp - logq
        d = (p * a).sum(-1)
    else:  # jsd: m = beta p + (1 - beta) q; dD/dp = beta (log p - log m)
        logm = torch.logaddexp(logp + math.log(beta), logq + math.log(1 - beta))
        d = beta * (p * (logp - logm)).sum(-1) + (1 - beta) * (logq.exp() * (logq - logm)).sum(-1)
        a = beta * (logp - logm)
    # through the softmax: dD/du_j = p_j (a_j - sum_i p_i a_i)
    return d, (p * (a - (p * a).sum(-1, keepdim=True)) if grad else None)
