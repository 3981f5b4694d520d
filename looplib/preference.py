"""Preference objectives (``loss=dpo``, ``loss=simpo``, ``loss=orpo``): trained on pairs of
completions of one prompt (``data=preference``), the chosen one to be preferred to the rejected.

Each is a loss objective like ``looplib.loss``'s: ``__call__(model, batch)`` returns the loss
**summed over the batch's pairs** and ``count(batch)`` the pairs, so the loop's normaliser (the
window's pairs over every micro-batch and rank) makes (batch 8) and (batch 2, accumulation 4)
the same update. A batch of B pairs is 2B sequences in one forward pass, the chosen rows first
(``looplib.data.preference.PairCollate``); a sequence's log-probability is the sum over its
completion tokens (labels not -100).

DPO compares the policy with a reference model, the policy as training started:

- under ``+peft=lora`` / ``qlora``: the same model with its adapters switched off (peft's
  ``disable_adapter()``), no second copy: no memory beyond the reference forward's activations
  (without gradients);
- full fine-tuning: a frozen copy of the starting weights (no gradients, eval mode, on the
  policy's device): one more copy of the weights in their dtype (a 1B-parameter fp32 model:
  4 GB more), and no optimizer state for it;
- ``loss.reference=precomputed`` (either): each pair's reference log-probabilities computed once
  before training by ``prepare`` and cached (``looplib.reference``): no copy, no reference
  forward while training; the pairs carry them into each batch (``reference_logps``).

Every DPO objective knows its reference's ``identity`` (the starting weights' digest; with
``precomputed`` the cache's key too): checkpoints keep it and a resume with another is refused.

The reference is taken by ``attach(model, engine)``, which looplib's runs call once the model is
on its device and before a resumed checkpoint is loaded, so a resumed run compares with the same
starting weights. The reference forward runs in eval mode (no dropout) without gradients.

Metrics (``train_metrics`` on logging steps, ``eval_metrics`` at evaluations): the mean chosen and
rejected rewards (``beta`` x the log-probability ratio to the reference; reference-free
objectives: ``beta`` x the mean log-probability per token), reward accuracy (the share of pairs
whose chosen reward is the higher), the margin (chosen minus rejected), and the completions'
log-probabilities as the objective uses them (DPO, either type: summed over the completion's
tokens, as its rewards; SimPO, ORPO: the mean per token); each a mean over the pairs.
"""
from __future__ import annotations

import copy
import logging
import math
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .loss import TokenCrossEntropy
from .schema import NonNegative, Positive

log = logging.getLogger("looplib")
METRICS = ("reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected")


class Preference(TokenCrossEntropy):
    """What the preference objectives share: pairs as items, sequence log-probabilities, metrics."""

    items = "pairs"
    pairs = True   # needs data of pairs (looplib.run.assembly refuses other data, and pairs for other objectives)
    average = False  # True: a sequence's log-probability is its mean per completion token

    def __init__(self, beta: Positive[float], label_smoothing: NonNegative[float] = 0.0, ignore_index: int = -100):
        super().__init__(ignore_index)
        if not 0 <= label_smoothing < 0.5:
            raise ConfigError("loss.label_smoothing", f"label_smoothing={label_smoothing} must be in [0, 0.5)",
                              "use loss.label_smoothing=0 (or e.g. 0.1: the share of pairs taken to be mislabelled)")
        self.beta, self.label_smoothing = beta, label_smoothing
        self.tallies = {True: None, False: None}   # training / evaluation sums (device tensors: no sync)

    def count(self, batch) -> int:
        if "chosen" not in batch:
            raise ConfigError("data", "a preference objective got a batch without pairs (no 'chosen' rows)",
                              "use data=preference (records with prompt, chosen and rejected)")
        return int(batch["chosen"].sum())

    def logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's summed log-probability of its completion tokens, and how many there are."""
        logits = model(batch["input_ids"], **self.inputs(model, batch))
        labels = batch["labels"]
        nll = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=self.ignore_index,
                              reduction="none").view(labels.shape)
        return -nll.sum(-1), (labels != self.ignore_index).sum(-1)

    def split(self, values: torch.Tensor, sizes: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) rows of ``values``, each a mean per token where ``average``."""
        if self.average:
            values = values / sizes.clamp(min=1)
        chosen = batch["chosen"]
        return values[chosen], values[~chosen]

    def tally(self, chosen_reward, rejected_reward, chosen_logp, rejected_logp) -> None:
        sums = torch.stack([chosen_reward.sum(), rejected_reward.sum(), (chosen_reward > rejected_reward).sum(),
                            torch.tensor(float(len(chosen_reward)), device=chosen_reward.device),
                            chosen_logp.sum(), rejected_logp.sum()]).detach().double()
        training = torch.is_grad_enabled()
        self.tallies[training] = sums if self.tallies[training] is None else self.tallies[training] + sums

    def metrics(self, training: bool, reduce=None, prefix: str = "") -> dict:
        sums, self.tallies[training] = self.tallies[training], None
        if sums is None:
            return {}
        if reduce is not None:
            sums = reduce(sums)
        rc, rr, right, n, lc, lr = sums.tolist()
        n = max(n, 1.0)
        values = (rc / n, rr / n, right / n, (rc - rr) / n, lc / n, lr / n)
        return {prefix + k: v for k, v in zip(METRICS, values)}

    def train_metrics(self, reduce=None) -> dict:
        """The pairs' rewards since the last logging step (then reset); ``reduce`` sums across ranks."""
        return self.metrics(True, reduce)

    def eval_metrics(self, reduce=None) -> dict:
        return self.metrics(False, reduce, "eval_")

    def smoothed(self, logits: torch.Tensor) -> torch.Tensor:
        """-log sigmoid(logits), with ``label_smoothing`` of the pairs taken the other way round."""
        ls = self.label_smoothing
        return -F.logsigmoid(logits) * (1 - ls) - F.logsigmoid(-logits) * ls


def adapters_of(model: torch.nn.Module):
    """The peft model inside ``model`` whose adapters can be switched off, or None."""
    return next((m for m in model.modules() if hasattr(m, "disable_adapter") and hasattr(m, "peft_config")), None)


class Reference:
    """An objective that compares the policy with the policy as training started (DPO; GRPO's KL):
    ``attach(model, engine)`` takes it (the module's docstring), ``reference_logps`` runs it."""

    label = "dpo"   # the loss option, for messages
    reference = adapters = None
    unsharded = None  # the copy taken before an engine shards the model (keep_before_sharding)

    def keep_before_sharding(self, model: torch.nn.Module) -> None:
        """Before an engine that shards the weights sets the model up (``looplib.run.assembly``):
        the frozen copy, whole, for ``attach`` to have the engine place (full fine-tuning only)."""
        if adapters_of(model) is None and getattr(self, "mode", "live") == "live":
            self.unsharded = copy.deepcopy(model).requires_grad_(False).eval()

    def attach(self, model: torch.nn.Module, engine=None) -> None:
        """Take the reference: the adapters' switch of a peft model, or a frozen copy of ``model``."""
        self.adapters = adapters_of(model)
        if self.adapters is not None:
            log.info("%s reference: the model with its LoRA adapters switched off (no second copy)", self.label.upper())
            return
        if not getattr(engine, "keeps_modules", True) and self.unsharded is not None \
                and callable(getattr(engine, "place_frozen", None)):
            self.reference, self.unsharded = engine.place_frozen(self.unsharded), None  # FSDP2: sharded as the policy
            size = sum(t.numel() * t.element_size() for t in self.reference.parameters())
            log.info("%s reference: a frozen copy of the starting weights, sharded (%.1f MB on each process)",
                     self.label.upper(), size / 2**20)
            return
        if not getattr(engine, "keeps_modules", True):
            raise ConfigError("loss", f"loss={self.label}'s reference for full fine-tuning is a frozen copy of the model, and "
                              f"+engine={getattr(engine, 'label', type(engine).__name__)} shards the model's weights, "
                              "which looplib does not copy yet", "use +peft=lora (the reference is the adapters "
                              "switched off), or the local or DDP engine")
        inner = engine.unwrap(model) if engine is not None else model
        self.reference = copy.deepcopy(inner).requires_grad_(False).eval()
        size = sum(t.numel() * t.element_size() for t in self.reference.state_dict().values())
        log.info("%s reference: a frozen copy of the starting weights (%.1f MB)", self.label.upper(), size / 2**20)

    @contextmanager
    def switched_off(self, model):
        """The model as training started: in eval mode, its adapters (if any) switched off."""
        was = model.training
        model.eval()
        try:
            with self.adapters.disable_adapter() if self.adapters is not None else nullcontext():
                yield
        finally:
            model.train(was)

    def reference_logps(self, model, batch):
        if self.reference is None and self.adapters is None:
            raise ConfigError("loss", f"loss={self.label} has no reference model: attach(model, engine) was not called",
                              "call objective.attach(model) before training (looplib's runs do it)")
        with torch.no_grad():
            if self.reference is not None:
                return self.logps(self.reference, batch)
            with self.switched_off(model):
                return self.logps(model, batch)


class DPO(Reference, Preference):
    """``loss=dpo``: Direct Preference Optimisation against a reference (the module's docstring).

    ``type=sigmoid``: ``-log sigmoid(beta * ((pc - pr) - (rc - rr)))`` per pair (with
    ``label_smoothing``), p the policy's and r the reference's summed log-probabilities, c the
    chosen and r the rejected completion. ``type=ipo``: ``(h - 1 / (2 beta))^2`` with h the same
    difference of mean log-probabilities per completion token."""

    def __init__(self, beta: Positive[float] = 0.1, label_smoothing: NonNegative[float] = 0.0,
                 type: Literal["sigmoid", "ipo"] = "sigmoid", reference: Literal["live", "precomputed"] = "live",
                 ignore_index: int = -100):
        super().__init__(beta, label_smoothing, ignore_index)
        if type not in ("sigmoid", "ipo"):
            raise ConfigError("loss.type", f"type={type!r} is not a DPO loss looplib has", "use loss.type=sigmoid or ipo")
        if type == "ipo" and label_smoothing:
            raise ConfigError("loss.label_smoothing", "loss.type=ipo takes no label smoothing",
                              "leave loss.label_smoothing=0 with loss.type=ipo")
        if reference not in ("live", "precomputed"):
            raise ConfigError("loss.reference", f"reference={reference!r} is not a way looplib keeps the reference",
                              "use loss.reference=live (a frozen copy, or the adapters switched off) or precomputed")
        self.type, self.mode = type, reference
        self.reference, self.adapters = None, None
        self.identity: dict | None = None  # the reference's (looplib.reference): kept in checkpoints, compared on resume

    def attach(self, model: torch.nn.Module, engine=None) -> None:
        """Take the reference: the adapters' switch of a peft model, or a frozen copy of ``model``
        (``precomputed``: neither; ``prepare`` then runs the model once). Its identity is the
        digest of the starting weights (``looplib.reference.weights_digest``)."""
        from .reference import weights_digest
        if self.mode == "precomputed" and not getattr(engine, "keeps_modules", True) \
                and not getattr(engine, "passes_before_training", False):  # FSDP2 reshards after them; ZeRO-3: untested
            raise ConfigError("loss.reference", f"loss.reference=precomputed runs the reference before training, "
                              f"which looplib does not do yet under +engine={getattr(engine, 'label', '?')} (it "
                              "shards the weights)", "use +peft=lora with loss.reference=live there, or the local, "
                              "DDP or FSDP engine")
        self.identity = {"mode": self.mode, "weights": weights_digest(model, engine)}
        self.identity["digest"] = self.identity["weights"]  # precomputed: the cache's key (prepare)
        if self.mode == "precomputed":
            self.adapters = adapters_of(model)  # computed once by ``prepare``, with the model as it is now: no copy
            return
        super().attach(model, engine)

    def prepare(self, model, corpus, engine, precision, batch_size: int) -> None:
        """``loss.reference=precomputed``: every pair's reference log-probabilities, computed once
        before training (or read from their cache) and carried by the pairs (``looplib.reference``)."""
        if self.mode == "precomputed":
            from .reference import precompute
            if self.identity is None:
                self.attach(model, engine)
            self.identity["digest"] = precompute(self, model, corpus, engine, precision, batch_size)

    def reference_logps(self, model, batch, live: bool = False):
        """The reference's summed log-probability of each row's completion: the batch's own
        (``reference_logps``, precomputed) or a forward pass (``live``: the precomputing pass)."""
        if not live and "reference_logps" in batch:
            return batch["reference_logps"], None
        if self.mode == "precomputed" and not live:
            raise ConfigError("loss.reference", "loss.reference=precomputed got a batch without the reference's "
                              "log-probabilities (prepare(model, corpus, engine, precision, batch_size) was not called)",
                              "call objective.prepare(...) once before training (looplib's runs do it), or use "
                              "loss.reference=live")
        if self.reference is None and self.adapters is None and self.mode != "precomputed":
            raise ConfigError("loss", "loss=dpo has no reference model: attach(model, engine) was not called",
                              "call objective.attach(model) before training (looplib's runs do it)")
        with torch.no_grad():
            if self.reference is not None:
                return self.logps(self.reference, batch)
            with self.switched_off(model):  # precomputed without adapters: the model as it starts
                return self.logps(model, batch)

    def __call__(self, model, batch) -> torch.Tensor:
        self.count(batch)  # a batch without pairs: refused
        policy, sizes = self.logps(model, batch)
        reference, _ = self.reference_logps(model, batch)
        c = batch["chosen"]
        pc, pr, rc, rr = policy[c], policy[~c], reference[c], reference[~c]
        if self.type == "ipo":  # the difference of mean log-probabilities per completion token
            nc, nr = sizes[c].clamp(min=1), sizes[~c].clamp(min=1)
            losses = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * self.beta)) ** 2
        else:
            losses = self.smoothed(self.beta * ((pc - pr) - (rc - rr)))
        # the rewards: beta x the summed log-probability ratios, for either type
        self.tally(self.beta * (pc - rc).detach(), self.beta * (pr - rr).detach(), pc.detach(), pr.detach())
        return losses.sum()


class SimPO(Preference):
    """``loss=simpo``: reference-free; ``-log sigmoid(beta * (mc - mr) - gamma)`` per pair, m the
    mean log-probability per completion token (with ``label_smoothing``)."""

    average = True

    def __init__(self, beta: Positive[float] = 2.0, gamma: float = 0.5, label_smoothing: NonNegative[float] = 0.0,
                 ignore_index: int = -100):
        super().__init__(beta, label_smoothing, ignore_index)
        self.gamma = gamma

    def __call__(self, model, batch) -> torch.Tensor:
        self.count(batch)
        policy, sizes = self.logps(model, batch)
        mc, mr = self.split(policy, sizes, batch)
        self.tally(self.beta * mc.detach(), self.beta * mr.detach(), mc.detach(), mr.detach())
        return self.smoothed(self.beta * (mc - mr) - self.gamma).sum()


class ORPO(Preference):
    """``loss=orpo``: reference-free; per pair the chosen completion's mean negative log-likelihood
    per token minus ``beta * log sigmoid(log odds ratio)``, the odds of a completion
    ``exp(m) / (1 - exp(m))`` with m its mean log-probability per token. The likelihood term is
    a mean per pair (the pair is the item), not over the micro-batch's chosen tokens."""

    average = True

    def __init__(self, beta: Positive[float] = 0.1, ignore_index: int = -100):
        super().__init__(beta, 0.0, ignore_index)

    def __call__(self, model, batch) -> torch.Tensor:
        self.count(batch)
        policy, sizes = self.logps(model, batch)
        mc, mr = self.split(policy, sizes, batch)
        odds = (mc - mr) - (log1mexp(mc) - log1mexp(mr))
        self.tally(self.beta * mc.detach(), self.beta * mr.detach(), mc.detach(), mr.detach())
        return (-mc - self.beta * F.logsigmoid(odds)).sum()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far from it."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
