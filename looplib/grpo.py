"""``loss=grpo``: reinforcement learning against a reward a program checks (Group Relative
Policy Optimisation), in looplib's loop as it is.

The completions are the data: ``Rollouts`` is the training data source of a run with this loss.
It holds the model and, each time the loop's accumulation window asks for a micro-batch, takes
the next batch of prompts (``data=prompts``), samples ``group_size`` completions of each from the
current policy, scores them (the ``reward`` group: ``looplib.reward.score``) and hands the loop a
batch of sequences with each completion's group-normalised advantage. A window's batches are
all sampled before its first forward (``looplib.accumulation`` forms the window first), so every
completion of a window comes from the weights of the step it trains.

``GRPO`` is then an objective like every other (``looplib.loss``): ``__call__(model, batch)``
returns the clipped token-level policy-gradient loss **summed** over the completion tokens
(with ``beta`` x the KL estimate ``exp(r - p) - (r - p) - 1`` to the reference, taken as DPO
takes it: ``looplib.preference.Reference``), and ``count(batch)`` the completion tokens, so the
loop divides by the window's completion tokens over every micro-batch and rank: (8 prompts) and
(4 prompts, accumulation 2) give the same update. The log-probabilities are those of the
sampling distribution (logits / ``temperature``); with one update per rollout the old policy is
the current one (ratio 1, its gradient the policy gradient). ``updates_per_rollout`` > 1 trains
each window that many times (``Replayed``), the ratio against the log-probabilities the batch
was sampled with (``old_logps``, taken once after sampling).

Sampling is batched and cached (``looplib.sampling.sample_groups``: every prompt's group at once)
and seeded per prompt: a ``torch.Generator`` seeded by (run seed, epoch, the prompt's record)
draws that prompt's rows, so the draws of a prompt do not depend on the batch size, the
accumulation or the process count, and a resumed run samples what the uninterrupted one sampled:
the generator's whole state is a function of the data position, which every checkpoint holds.
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Annotated, Callable

import torch
import torch.nn.functional as F

from .accumulation import Accumulation, Window
from .errors import ConfigError
from .loss import TokenCrossEntropy
from .preference import Reference
from .reward import score
from .sampling import nucleus, sample, sample_groups  # noqa: F401 (nucleus, sample: their home was here)
from .schema import NonNegative, Positive, Range

log = logging.getLogger("looplib")
METRICS = ("reward", "reward_std", "completion_tokens", "clipped", "kl", "entropy", "rollout_tokens_per_s")


class GRPO(Reference, TokenCrossEntropy):
    """``loss=grpo`` (the module's docstring). ``epsilon``/``epsilon_high``: the ratio's clip range
    ``[1 - epsilon, 1 + epsilon_high]`` (``epsilon_high`` None: ``epsilon``); ``scale_rewards``:
    divide each group's centred rewards by its standard deviation (+1e-4)."""

    items = "tokens"
    label = "grpo"
    rollouts_needed = True   # needs data=prompts and a reward (looplib.run.rules)

    def __init__(self, group_size: Annotated[int, Range(ge=2)] = 4, max_new_tokens: Positive[int] = 64,
                 temperature: Positive[float] = 1.0, top_p: Annotated[float, Range(gt=0, le=1)] = 1.0,
                 epsilon: Positive[float] = 0.2, epsilon_high: Positive[float] | None = None,
                 beta: NonNegative[float] = 0.0, scale_rewards: bool = True, ignore_index: int = -100,
                 updates_per_rollout: Positive[int] = 1):
        super().__init__(ignore_index)
        if updates_per_rollout < 1:
            raise ConfigError("loss.updates_per_rollout", f"updates_per_rollout={updates_per_rollout}: a rollout "
                              "trains at least one step", "use loss.updates_per_rollout=1 or more")
        self.updates_per_rollout = updates_per_rollout
        if group_size < 2:
            raise ConfigError("loss.group_size", f"group_size={group_size}: a group of one has no advantage",
                              "use loss.group_size=2 or more (e.g. 8)")
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self.epsilon, self.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
        self.beta, self.scale_rewards = beta, scale_rewards
        self.tallies = {True: None, False: None}
        self.sampled = [0.0, 0.0]   # tokens sampled and seconds spent sampling since the last logging step (Rollouts)
        self.reward_sums = {}       # a Weighted reward's parts: name -> [sum, sum of squares, count] (Rollouts)

    def attach(self, model, engine=None) -> None:
        if self.beta:  # the reference only where the KL is asked for (no copy otherwise)
            super().attach(model, engine)

    def count(self, batch) -> int:
        if "advantages" not in batch:
            raise ConfigError("data", "loss=grpo got a batch without completions (no 'advantages')",
                              "use data=prompts with a reward (+reward=exact_answer): the completions are sampled")
        return int((batch["labels"] != self.ignore_index).sum())

    def logps(self, model, batch, entropy: bool = False) -> torch.Tensor:
        """Each label's log-probability under the sampling distribution (0 where not counted);
        ``entropy``: also the distribution's entropy summed over the counted tokens (``self.entropy``)."""
        logits = model(batch["input_ids"], **self.inputs(model, batch)).float() / self.temperature
        labels = batch["labels"]
        if entropy:
            self.entropy = summed_entropy(logits.detach().flatten(0, -2), labels.flatten() != self.ignore_index)
        return -F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=self.ignore_index,
                                reduction="none").view(labels.shape)

    def __call__(self, model, batch) -> torch.Tensor:
        self.count(batch)
        mask = (batch["labels"] != self.ignore_index).float()
        logp = self.logps(model, batch, entropy=True)
        old = batch.get("old_logps")
        old = logp.detach() if old is None else old
        ratio = torch.exp(logp - old)
        adv = batch["advantages"].to(logp.dtype)[:, None]
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        kl = torch.zeros_like(logp)
        if self.beta:
            ref = self.reference_logps(model, batch)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            per_token = per_token + self.beta * kl
        self.tally(batch, mask, ((ratio - clipped).abs() > 0).float() * mask, kl * mask)
        return (per_token * mask).sum()

    def tally(self, batch, mask, clipped, kl) -> None:
        rewards = batch.get("rewards")
        if rewards is None:
            return
        rewards = rewards.to(mask.device, torch.float64)
        sums = torch.stack([rewards.sum(), (rewards ** 2).sum(), torch.tensor(float(len(rewards)), device=mask.device,
                            dtype=torch.float64), mask.sum().double(), clipped.sum().double(), kl.sum().double(),
                            self.entropy.double()])
        training = torch.is_grad_enabled()
        self.tallies[training] = sums.detach() if self.tallies[training] is None else self.tallies[training] + sums

    def train_metrics(self, reduce=None) -> dict:
        """Since the last logging step: the mean and spread of the reward, completion tokens per
        completion, the share of tokens whose ratio was clipped, the KL per token (then reset)."""
        sums, self.tallies[True] = self.tallies[True], None
        if sums is None:
            return {}
        names = sorted(self.reward_sums)  # (the same on every rank: one reward config)
        host = self.sampled + [v for name in names for v in self.reward_sums[name]]
        sums = torch.cat([sums, torch.tensor(host, dtype=sums.dtype, device=sums.device)])
        self.sampled, self.reward_sums = [0.0, 0.0], {}
        if reduce is not None:
            sums = reduce(sums)
        r, r2, n, tokens, clipped, kl, entropy, sampled, seconds, *parts = sums.tolist()
        n, tokens = max(n, 1.0), max(tokens, 1.0)
        out = dict(zip(METRICS, (*mean_std(r, r2, n), tokens / n, clipped / tokens, kl / tokens, entropy / tokens,
                                 sampled / seconds if seconds else 0.0)))
        for i, name in enumerate(names):  # each part of a Weighted reward, unweighted
            out[f"reward_{name}"], out[f"reward_{name}_std"] = mean_std(*parts[3 * i:3 * i + 3])
        return out

    def accumulation(self, steps: int, state, engine=None) -> Accumulation:
        """The loop's windows: ``updates_per_rollout`` > 1 trains each window of rollouts that many
        times (``Replayed``); 1: ``Accumulation(steps)``."""
        if self.updates_per_rollout == 1:
            return Accumulation(steps)
        return Replayed(steps, self.updates_per_rollout, state, engine)

    def rollouts(self, loader, model: Callable[[], torch.nn.Module], reward, data, engine, precision, seed: int):
        """The run's training data: ``loader``'s prompts, sampled and scored (``Rollouts``)."""
        return Rollouts(loader, self, model, reward, data, engine, precision, seed)


def summed_entropy(logits: torch.Tensor, counted: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The entropy of softmax(``logits``) summed over the ``counted`` rows, ``chunk`` rows at a time (no
    second copy of the whole logits), without gradients."""
    rows = counted.nonzero().squeeze(1)
    total = logits.new_zeros(())
    with torch.no_grad():
        for start in range(0, len(rows), chunk):
            part = logits[rows[start:start + chunk]]
            total += torch.special.entr(torch.softmax(part, dim=-1)).sum()  # (a padded vocabulary's -inf: 0)
    return total


def mean_std(total: float, squares: float, n: float) -> tuple[float, float]:
    n = max(n, 1.0)
    mean = total / n
    return mean, max(squares / n - mean * mean, 0.0) ** 0.5


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """Each reward less its group's mean, divided by the group's standard deviation (+1e-4) when ``scale``."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + 1e-4)
    return centred.flatten()


def prompt_seed(seed: int, epoch: int, index: int) -> int:
    """The generator seed of one prompt's group in one epoch."""
    return (seed * 1_000_003 + epoch * 999_983 + index * 7_919 + 1) % 2**63


class Rollouts:
    """The training data of ``loss=grpo`` (the module's docstring): iterating yields one rollout
    batch per batch of ``loader``'s prompts. ``sampler``, ``batch_size`` and ``generator`` are the
    loader's, so ``looplib.data.Epochs`` seeds, counts and resumes it as it does the loader."""

    def __init__(self, loader, objective: GRPO, model: Callable[[], torch.nn.Module], reward, data, engine,
                 precision, seed: int):
        self.loader, self.objective, self.model, self.reward = loader, objective, model, reward
        self.data, self.engine, self.precision, self.seed = data, engine, precision, seed
        self.sampler, self.batch_size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
        self.generator = getattr(loader, "generator", None)
        self.stop = getattr(data, "eos_id", None)
        self.pad = next((i for i in (getattr(data, "pad_id", None), self.stop) if i is not None), 0)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for prompts in self.loader:
            yield self.rollout(prompts)

    def completions(self, prompts: dict) -> list[torch.Tensor]:
        """Each prompt's ``group_size`` completions, sampled together in eval mode without gradients
        (``looplib.sampling.sample_groups``), each prompt's rows with its own seeded generator."""
        o, device = self.objective, self.engine.device
        model = self.engine.unwrap(self.model())
        epoch = getattr(self.sampler, "epoch", 0)
        was, t0 = model.training, time.perf_counter()
        gens = [torch.Generator(device).manual_seed(prompt_seed(self.seed, epoch, index))
                for index in prompts["index"].tolist()]
        model.eval()
        try:
            with torch.no_grad(), self.precision.autocast():
                out = sample_groups(model, [ids.to(device) for ids in prompts["prompt_ids"]], o.group_size,
                                    o.max_new_tokens, o.temperature, o.top_p, self.stop, gens, self.pad, self.finished)
        finally:
            model.train(was)
        o.sampled[0] += sum(g.numel() for g in out)  # (read back with the stop checks already: no extra sync)
        o.sampled[1] += time.perf_counter() - t0
        return out

    def finished(self, done: torch.Tensor) -> bool:
        """Every row done, on every process: their forwards stay in step (FSDP gathers in each one)."""
        if self.engine.world_size == 1:
            return bool(done.all())
        return int(self.engine.ranks.sum((~done).sum())) == 0

    def rollout(self, prompts: dict) -> dict:
        """A batch of prompts -> sequences, labels on the completion tokens (through the first
        ``stop``), each completion's reward and advantage."""
        o, g = self.objective, self.objective.group_size
        groups = self.completions(prompts)
        rows, texts = [], []
        for ids, group in zip(prompts["prompt_ids"], groups):
            for completion in group.cpu():
                ended = (completion == self.stop).nonzero() if self.stop is not None else []
                length = int(ended[0]) + 1 if len(ended) else len(completion)
                rows.append((ids, completion[:length]))
                texts.append(self.data.decode(completion[:length - 1 if len(ended) else length].tolist()))
        field = getattr(self.data, "prompt_field", "prompt")
        records = [r for r in map(copy.deepcopy, prompts["records"]) for _ in range(g)]  # (a reward may change them)
        rewards = score(self.reward, [r.get(field) for r in records], texts, records, o.reward_sums)
        width = max(len(p) + len(c) for p, c in rows) - 1
        batch = {"input_ids": torch.full((len(rows), width), self.pad, dtype=torch.long),
                 "labels": torch.full((len(rows), width), o.ignore_index, dtype=torch.long),
                 "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
        for i, (p, c) in enumerate(rows):
            seq = torch.cat([p, c])
            batch["input_ids"][i, :len(seq) - 1], batch["attention_mask"][i, :len(seq) - 1] = seq[:-1], 1
            batch["labels"][i, len(p) - 1:len(seq) - 1] = c
        batch["rewards"] = rewards.float()
        batch["advantages"] = group_advantages(rewards, g, o.scale_rewards).float()
        if o.updates_per_rollout > 1:
            batch["old_logps"] = self.old_logps(batch)
        return batch

    def old_logps(self, batch: dict) -> torch.Tensor:
        """The completion tokens' log-probabilities under the policy that sampled them (eval mode, no
        gradients), on the host: the ratio's denominator for every update on this rollout (the first's
        ratio is then 1 where the training forward computes what this one does: no dropout)."""
        model = self.engine.unwrap(self.model())
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), self.precision.autocast():
                return self.objective.logps(model, self.engine.to_device(dict(batch))).float().cpu()
        finally:
            model.train(was)


class Replayed(Accumulation):
    """``loss.updates_per_rollout`` = ``updates`` > 1: each window (a rollout batch: ``steps``
    micro-batches of sampled completions, with the log-probabilities they were sampled with) is
    trained ``updates`` times in a row, one optimizer step each; the data stream moves on once.

    Resume mid-rollout: the completions were sampled by weights that the first updates have since
    changed, so they cannot be sampled again; the rollout is kept in the run's state instead
    (``state.extra["rollout"]``: every process's micro-batches, on the host, and the updates done),
    which every checkpoint holds, and a resumed run trains the same batches its remaining times.
    It resumes only on the processes it was saved on (each holds its own prompts' rollouts)."""

    def __init__(self, steps: int, updates: int, state, engine=None):
        super().__init__(steps)
        self.updates, self.state, self.engine = updates, state, engine
        self.rank = getattr(engine, "rank", 0)
        self.world = getattr(engine, "world_size", 1)
        self.check(state.extra.get("rollout"))  # (made after the resume: refused before anything is written)

    def check(self, pending: dict | None) -> None:
        if pending is not None and len(pending["batches"]) != self.world:
            raise ConfigError("resume", f"the checkpoint was saved between the updates of a rollout on "
                              f"{len(pending['batches'])} process(es), and this run has {self.world}; its "
                              "rollouts are each process's own", "resume on the same number of processes")

    def windows(self, epochs, count):
        pending = self.state.extra.pop("rollout", None)
        if pending is not None:  # a checkpoint saved between the updates of one rollout
            self.check(pending)
            batches = pending["batches"]
            yield from self.replay(self.close(batches[self.rank], count), pending["done"], batches)
        for window in super().windows(epochs, count):
            yield from self.replay(window, 0, None)

    def replay(self, window: Window, done: int, every: list | None):
        every = every if every is not None else self.gather(window.batches)
        for n in range(done, self.updates):
            if n + 1 < self.updates:  # what a checkpoint after this step holds
                self.state.extra["rollout"] = {"batches": every, "done": n + 1}
            else:
                self.state.extra.pop("rollout", None)
            yield window

    def gather(self, batches: list[dict]) -> list[list[dict]]:
        """Every process's micro-batches of this rollout (rank 0 writes the checkpoint)."""
        if self.world == 1:
            return [batches]
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, batches)
        return out
