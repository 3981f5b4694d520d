"""Objectives: run the model on a batch and return the *summed* loss, and count its items.

The loop divides the summed loss by the number of loss-bearing items in the whole
accumulation window (see ``accumulation.py``), so (batch B, accumulation 1) and
(batch B/k, accumulation k) give the same update even when micro-batches hold different
numbers of tokens.

Bring your own: any object with

    __call__(model, batch) -> scalar tensor, the loss summed over the batch's items
    count(batch) -> int, how many items that sum is over (computed on the host batch)

works as ``loss._target_=my_pkg.MyObjective``.
"""
from __future__ import annotations

import inspect
import weakref

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, need
from .schema import Positive

OPTIONAL_INPUTS = ("attention_mask", "position_ids")


class TokenCrossEntropy:
    """Next-token language modelling: batch = {"input_ids", "labels"}; labels equal to
    ``ignore_index`` (padding, prompt tokens) carry no loss and are not counted."""

    items = "tokens"   # what count() counts: telemetry's throughput is <items>_per_s

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index
        self.accepted = weakref.WeakKeyDictionary()   # model -> the optional inputs its forward takes

    def __call__(self, model, batch) -> torch.Tensor:
        logits = model(batch["input_ids"], **self.inputs(model, batch))
        return F.cross_entropy(logits.flatten(0, -2).float(), batch["labels"].flatten(),
                               ignore_index=self.ignore_index, reduction="sum")

    def inputs(self, model, batch) -> dict:
        """``attention_mask``/``position_ids`` of the batch, for a model that takes them. A model
        without ``attention_mask`` (the bundled GPT) is given none: padding is on the right and
        attention causal, so real tokens never see it. Packed examples (``position_ids``) would
        see each other in a model without ``position_ids``: refused."""
        present = [k for k in OPTIONAL_INPUTS if k in batch]
        if not present:
            return {}
        if model not in self.accepted:
            self.accepted[model] = accepted_inputs(model)
        if "position_ids" in present and "position_ids" not in self.accepted[model]:
            raise ConfigError("data.pack", f"{type(model).__name__} takes no position_ids, so packed examples "
                              "would attend to one another", "use data.pack=false, or a transformers model (model=hf)")
        return {k: batch[k] for k in present if k in self.accepted[model]}

    def count(self, batch) -> int:
        labels = batch["labels"]
        refuse_unshifted(batch.get("input_ids"), labels, self.ignore_index, batch.get("position_ids"))
        return int((labels != self.ignore_index).sum())


def refuse_unshifted(ids, labels, ignore_index: int = -100, positions=None) -> None:
    """Refuse labels that are not shifted to the next token: equal to ``input_ids`` at every
    position that carries a loss (the Hugging Face convention: ``labels`` = ``input_ids`` with the
    prompt and padding masked to -100, shifted inside the model). Such labels would teach the model
    to copy its input. It cannot misfire on shifted labels: ``labels[t] = ids[t+1]`` equals
    ``ids[t]`` only where a token repeats, so at least one counted position t with
    ``ids[t] != ids[t+1]`` is required (a batch of one repeated token is its own shift), within one
    example (``positions``: packed examples' ``position_ids``; an example's last label is not the
    next example's first token)."""
    if ids is None or not torch.is_tensor(labels) or not torch.is_tensor(ids) or labels.shape != ids.shape \
            or labels.dim() == 0 or labels.dtype.is_floating_point:
        return
    counted = labels != ignore_index
    # torch.equal answers without Tensor.__bool__: every batch is checked as it is counted, and the loop
    # reads nothing back between logging steps (what the sync-count tests hold it to)
    if not torch.equal(torch.where(counted, labels, ids), ids):
        return
    changes = counted[..., :-1] & (ids[..., 1:] != ids[..., :-1])  # a counted position whose next token differs
    if torch.is_tensor(positions) and positions.shape == ids.shape:
        changes &= positions[..., 1:] == positions[..., :-1] + 1
    if not bool(changes.any()):
        return
    every = bool(counted.all())
    raise ConfigError("data", f"the batch's labels equal its input_ids{'' if every else f' wherever they are not {ignore_index}'}: "
                      "the Hugging Face convention (labels unshifted, the model shifts them), but looplib's labels "
                      "are already shifted (labels[t] = input_ids[t+1]), so the model would learn to copy its input",
                      "shift them: labels[t] = labels[t+1] and -100 last (looplib.data.shift_labels(sample) does it), "
                      "or build samples with looplib.data.next_token_example")


class SequenceCrossEntropy(TokenCrossEntropy):
    """Classification of whole sequences: batch = {"input_ids", "labels"[, "attention_mask"]}.

    Its items are sequences (throughput in sequences/s); in evaluation (no gradients) it also
    counts correct predictions on the device, read once by ``eval_metrics`` (accuracy)."""

    items = "sequences"

    def __init__(self, ignore_index: int = -100):
        super().__init__(ignore_index)
        self.correct, self.seen = 0, 0

    def __call__(self, model, batch) -> torch.Tensor:
        logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
        labels = batch["labels"]
        if not torch.is_grad_enabled():  # evaluation: tally accuracy (device tensors, no sync)
            counted = labels != self.ignore_index
            self.correct = self.correct + ((logits.argmax(-1) == labels) & counted).sum()
            self.seen = self.seen + counted.sum()
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")

    def eval_metrics(self, reduce=None) -> dict:
        """Accuracy over the sequences evaluated since the last call (then reset); ``reduce``
        adds a tensor up across ranks (each evaluated its share of the held-out set)."""
        correct, seen, self.correct, self.seen = self.correct, self.seen, 0, 0
        counts = torch.tensor([float(correct), float(seen)], dtype=torch.float64)
        if reduce is not None:
            counts = reduce(counts)
        correct, seen = counts.tolist()
        return {"eval_accuracy": correct / max(seen, 1.0)}


class CausalLMLoss(TokenCrossEntropy):
    """Next-token cross-entropy for a model whose forward returns an object with ``.logits`` (an
    unwrapped ``transformers`` model, for the Python API).

    Labels come already shifted from looplib's datasets, so the model is *not* given labels
    (transformers would shift them again and average them per micro-batch); the loss is summed
    and counted like ``TokenCrossEntropy``'s, so accumulation stays exact.
    """

    def __call__(self, model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        return super().__call__(lambda _ids, **_: out.logits, batch)


def accepted_inputs(model: nn.Module) -> frozenset:
    """Which of ``OPTIONAL_INPUTS`` ``model``'s forward takes, looking through wrappers that pass
    ``**kwargs`` on (DDP, torch.compile, peft, DeepSpeed) to the module they wrap."""
    params = inspect.signature(getattr(model, "forward", model)).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    found = named.intersection(OPTIONAL_INPUTS)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        inner = next((m for m in (getattr(model, a, None) for a in ("module", "_orig_mod", "base_model", "model"))
                      if isinstance(m, nn.Module) and m is not model), None)
        found |= accepted_inputs(inner) if inner is not None else set(OPTIONAL_INPUTS)
    return frozenset(found)


class ChunkedTokenCrossEntropy(TokenCrossEntropy):
    """``loss=lm_chunked``: next-token cross-entropy that never holds the whole logits tensor.

    The model returns its final hidden states (``model(input_ids, hidden_only=True)``) and the
    loss applies the output projection (``lm_head``) ``chunk_size`` tokens at a time: each
    chunk's logits are made, turned into that chunk's loss and its gradients with respect to
    the hidden states and the head, and dropped (the fused linear + cross-entropy of Liger
    Kernel, written on PyTorch). Peak memory for the logits falls from tokens x vocab (in fp32
    and in the autocast dtype, kept for backward) to chunk_size x vocab; the matmuls are the
    plain loss's (one forward, two backward), so nothing is recomputed. Summed and counted like
    ``loss=lm`` (labels equal to ``ignore_index`` carry no loss and no gradient).

    The model must take ``hidden_only=True`` and expose ``lm_head`` (an ``nn.Linear``): the
    bundled GPT does, and so does ``looplib.hf.CausalLM`` (its ``get_output_embeddings()``).
    """

    def __init__(self, ignore_index: int = -100, chunk_size: Positive[int] = 1024):
        super().__init__(ignore_index)
        if chunk_size < 1:
            raise ConfigError("loss.chunk_size", f"chunk_size={chunk_size} must be at least 1",
                              "use e.g. loss.chunk_size=1024 (tokens per chunk)")
        self.chunk_size = chunk_size

    def __call__(self, model, batch) -> torch.Tensor:
        # through any wrapper (DDP's hooks, compile), with the batch's mask / positions where the model takes them
        hidden = model(batch["input_ids"], hidden_only=True, **self.inputs(model, batch))
        head, vocab = output_head(model)
        return linear_cross_entropy(hidden.flatten(0, -2), head.weight, head.bias, batch["labels"].flatten(),
                                    vocab, self.ignore_index, self.chunk_size)


class LigerTokenCrossEntropy(ChunkedTokenCrossEntropy):
    """``loss=lm_liger``: the same computation with Liger Kernel's fused linear + cross-entropy
    (Triton kernels, CUDA only; ``pip install 'looplib[liger]'``, imported only when chosen)."""

    def __init__(self, ignore_index: int = -100):
        super().__init__(ignore_index)
        if not torch.cuda.is_available():
            raise ConfigError("loss", "loss=lm_liger needs a CUDA GPU (liger-kernel's kernels are Triton)",
                              "use loss=lm_chunked (the same loss on PyTorch, any device)")
        liger = need("liger_kernel.transformers", "liger", "loss", "loss=lm_liger", "use loss=lm_chunked",
                     package="liger-kernel")
        self.fused = liger.LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction="sum")

    def __call__(self, model, batch) -> torch.Tensor:
        hidden = model(batch["input_ids"], hidden_only=True, **self.inputs(model, batch))
        head, vocab = output_head(model)
        if hidden.device.type != "cuda":
            raise ConfigError("loss", f"loss=lm_liger needs a CUDA device, the model is on {hidden.device}",
                              "use loss=lm_chunked, or device=cuda")
        bias = None if head.bias is None else head.bias[:vocab]
        return self.fused(head.weight[:vocab], hidden.flatten(0, -2), batch["labels"].flatten(), bias)


def output_head(model) -> tuple[torch.nn.Linear, int]:
    """The model's ``lm_head`` (through DDP / DeepSpeed / PEFT wrappers) and the number of real
    vocabulary entries (rows past it are padding: ``GPT(pad_vocab_to=...)``)."""
    inner = model
    while not hasattr(inner, "lm_head"):
        nested = getattr(inner, "module", None)  # DistributedDataParallel, DeepSpeedEngine
        if nested is None:
            raise ConfigError("loss", f"{type(model).__name__} has no lm_head (the output projection) for a "
                              "chunked loss", "use loss=lm, or give the model an lm_head and hidden_only=True")
        inner = nested
    head = inner.lm_head
    if head.weight.dim() != 2 or head.weight.numel() == 0:  # DeepSpeed ZeRO-3 keeps only a shard outside forward
        raise ConfigError("loss", "the chunked loss needs the whole lm_head weight outside the model's forward, "
                          "and this engine partitions it (ZeRO-3)", "use loss=lm, or engine.stage=2")
    vocab = int(getattr(inner, "vocab_size", head.weight.shape[0]))
    if hasattr(head.weight, "full_tensor") and not torch.is_grad_enabled():
        # FSDP2 reshards the root after a forward without gradients (looplib.engines.fsdp): the
        # whole weight gathered for this loss alone (in training the root stays gathered until backward)
        return SimpleNamespace(weight=head.weight.full_tensor(),
                               bias=None if head.bias is None else head.bias.full_tensor()), vocab
    return head, vocab


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, vocab: int | None = None, ignore_index: int = -100,
                         chunk_size: int = 1024) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias)[:, :vocab].float(), labels, reduction="sum")``
    without the (rows x vocab) logits: ``chunk_size`` rows at a time."""
    # which gradients to make: decided here, since autograd runs Function.forward without grad mode
    wanted = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias))
    return LinearCrossEntropy.apply(hidden, weight, bias, labels, vocab or weight.shape[0], ignore_index,
                                    chunk_size, wanted)


class LinearCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(hidden @ weight.T + bias, labels))`` over ``vocab`` columns, a chunk of
    rows at a time. Gradients are made in forward, chunk by chunk, so no chunk's logits outlive
    it; backward only scales them by the incoming gradient (a scalar)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, vocab: int, ignore_index: int, chunk_size: int, wanted):
        grad = any(wanted)
        # under autocast the matmuls run in its dtype, as nn.Linear's would; sums stay in fp32
        kind = hidden.device.type
        low = torch.get_autocast_dtype(kind) if torch.amp.is_autocast_available(kind) and \
            torch.is_autocast_enabled(kind) else None
        compute = low or hidden.dtype
        acc = torch.promote_types(compute, torch.float32)  # softmax and sums: fp32 at least
        w = weight.to(compute)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if wanted[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if wanted[2] else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start:start + chunk_size].to(compute), labels[start:start + chunk_size]
            logits = torch.mm(h, w.t())
            if bias is not None:
                logits = logits + bias.to(compute)
            logits = logits[:, :vocab].to(acc)
            keep = (y != ignore_index)
            target = torch.where(keep, y, 0)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            # log-sum-exp and softmax in place of the logits (torch.logsumexp would hold a second copy)
            top = logits.amax(dim=-1, keepdim=True)
            sums = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
            total += ((sums.log() + top).squeeze(1) - picked).mul(keep).sum()
            if not grad:
                continue
            probs = logits.div_(sums)  # softmax
            probs.scatter_add_(1, target[:, None], -torch.ones_like(probs[:, :1]))
            probs.mul_(keep[:, None])  # ignored rows: no gradient
            if vocab != weight.shape[0]:
                probs = F.pad(probs, (0, weight.shape[0] - vocab))  # padded vocabulary rows: zero gradient
            g = probs.to(compute)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk_size] = torch.mm(g, w)
            if grad_weight is not None and grad_weight.dtype == compute:
                grad_weight.addmm_(g.t(), h)  # no (vocab x width) temporary
            elif grad_weight is not None:
                grad_weight += torch.mm(g.t(), h)  # autocast: the product in its dtype, summed in fp32
            if grad_bias is not None:
                grad_bias += probs.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes, ctx.done = (weight.dtype, None if bias is None else bias.dtype), False
        return total

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.done:
            raise RuntimeError("a chunked loss can be backpropagated once (its gradients are scaled in place)")
        ctx.done = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors

        def scale(g, dtype):  # in place: no second (vocab x width) buffer at the peak
            return None if g is None else g.mul_(grad_output).to(dtype)
        return (scale(grad_hidden, grad_hidden.dtype if grad_hidden is not None else None),
                scale(grad_weight, ctx.dtypes[0]), scale(grad_bias, ctx.dtypes[1]), None, None, None, None, None)
