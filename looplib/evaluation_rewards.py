"""Rewards as an evaluation: a finished model's completions of prompts (``data=prompts``), scored
by a reward (the ``reward`` group), summed up as the mean reward and pass@k.

``python -m looplib.evaluate RUN data=prompts data.path=held_out.jsonl +reward=exact_answer``
(``looplib.cli.evaluate``) loads the run, the prompts and the reward, then calls ``evaluate``:

- each prompt's ``n`` completions are sampled as ``loss=grpo`` samples them in training
  (``looplib.sampling.sample_groups``, the model in eval mode without gradients), with the prompt's own
  ``torch.Generator`` seeded by (``seed``, the prompt's record: ``looplib.grpo.prompt_seed``,
  epoch 0), so an evaluation is reproducible and a prompt's completions do not depend on the
  others; ``completions`` is the one call of the sampler;
- each completion is decoded up to its first end-of-text token and scored with its prompt and
  record as in training (``looplib.reward.score``: a reward that breaks its contract is refused in
  one line);
- a completion *passes* where its reward is at least ``threshold`` (1 by default: the right
  answer of ``+reward=exact_answer``); pass@k is the unbiased estimator over the ``n`` completions
  of each prompt (``pass_at_k``), averaged over the prompts.

Nothing here knows of files or the command line: ``summary`` makes the record the command writes
(JSON), ``table`` the text it prints.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .grpo import mean_std, prompt_seed
from .sampling import sample_groups
from .reward import score


@dataclass
class Sampling:
    """How completions are sampled: ``n`` per prompt, at most ``max_new_tokens`` each, from
    softmax(logits / ``temperature``) kept to its ``top_p`` nucleus; ``seed`` seeds each prompt's
    generator (with the prompt's record)."""
    n: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Evaluated:
    """What ``evaluate`` found: per prompt, its record's index and its completions' texts and
    rewards; per part of a ``Weighted`` reward, ``[sum, sum of squares, count]`` (unweighted)."""
    indices: list[int] = field(default_factory=list)
    texts: list[list[str]] = field(default_factory=list)
    rewards: list[list[float]] = field(default_factory=list)
    parts: dict = field(default_factory=dict)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` pass: the chance that k
    of them drawn without replacement hold at least one that passes, 1 - C(n-c, k) / C(n, k)
    (computed as a product: no huge binomials). ``k`` at most ``n``."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def completions(model, prompt_ids: torch.Tensor, index: int, s: Sampling, stop: int | None,
                device: torch.device) -> torch.Tensor:
    """The ``s.n`` completions of one prompt (``(n, new)`` ids; a row that sampled ``stop`` is
    padded with it), as ``loss=grpo`` samples them: its generator seeded by (seed, epoch 0, index)."""
    generator = torch.Generator(device).manual_seed(prompt_seed(s.seed, 0, index))
    return sample_groups(model, [prompt_ids.to(device)], s.n, s.max_new_tokens, s.temperature, s.top_p, stop,
                         [generator])[0]  # (the model's cache where it has one: token for token the uncached sampler)


def decoded(group: torch.Tensor, stop: int | None, decode: Callable[[list[int]], str]) -> list[str]:
    """Each completion's text, up to (without) its first ``stop`` token, as training decodes it."""
    out = []
    for row in group.cpu():
        ended = (row == stop).nonzero() if stop is not None else []
        out.append(decode(row[:int(ended[0])].tolist() if len(ended) else row.tolist()))
    return out


def evaluate(model, prompts, reward, s: Sampling, decode: Callable[[list[int]], str], stop: int | None,
             device: torch.device, prompt_field: str = "prompt", each: Callable[[int], None] | None = None) -> Evaluated:
    """Sample, decode and score ``s.n`` completions of every prompt of ``prompts`` (a
    ``looplib.data.prompts.PromptExamples``: ``prompts[i]`` gives ``prompt_ids``, ``index`` and
    ``records``). ``model(ids) -> logits``; ``each(i)`` is called after prompt i (progress)."""
    out = Evaluated()
    was = model.training
    model.eval()
    try:
        for i in range(len(prompts)):
            item = prompts[i]
            with torch.no_grad():
                group = completions(model, item["prompt_ids"], item["index"], s, stop, device)
            texts = decoded(group, stop, decode)
            records = [copy.deepcopy(item["records"]) for _ in texts]  # (a reward may change them)
            values = score(reward, [r.get(prompt_field) for r in records], texts, records, out.parts)
            out.indices.append(int(item["index"]))
            out.texts.append(texts)
            out.rewards.append(values.tolist())
            if each is not None:
                each(i)
    finally:
        model.train(was)
    return out


def summary(found: Evaluated, s: Sampling, ks: list[int], threshold: float, reward_name: str) -> dict:
    """The evaluation's numbers: the reward's mean and std over every completion (and each part's,
    unweighted, for a ``Weighted`` reward), pass@k for each k, the counts and the sampling."""
    flat = [v for group in found.rewards for v in group]
    rewards = {reward_name: dict(zip(("mean", "std"), mean_std(sum(flat), sum(v * v for v in flat), len(flat))))}
    for name, (total, squares, count) in found.parts.items():
        rewards[name] = dict(zip(("mean", "std"), mean_std(total, squares, count)))
    passed = [sum(v >= threshold for v in group) for group in found.rewards]
    pass_k = {str(k): sum(pass_at_k(s.n, c, k) for c in passed) / max(len(passed), 1) for k in ks}
    return {"prompts": len(found.rewards), "samples_per_prompt": s.n, "completions": len(flat),
            "rewards": rewards, "pass_threshold": threshold, "pass_at_k": pass_k, "sampling": asdict(s)}


def samples(found: Evaluated, threshold: float, prompt: Callable[[int], object] = lambda index: None) -> str:
    """One JSON line per completion: the prompt's record index (and ``prompt(index)``), the
    sample's number, its text, its reward and whether it passed."""
    import json
    return "".join(json.dumps({"index": index, "prompt": prompt(index), "sample": j, "completion": text, "reward": value,
                               "passed": value >= threshold}) + "\n"
                   for index, texts, values in zip(found.indices, found.texts, found.rewards)
                   for j, (text, value) in enumerate(zip(texts, values)))


def table(result: dict) -> str:
    """The numbers as the command prints them: one row per reward (mean, std), one per pass@k."""
    s = result["sampling"]
    head = (f"{result['prompts']} prompts x {result['samples_per_prompt']} samples (temperature {s['temperature']}, "
            f"top_p {s['top_p']}, max_new_tokens {s['max_new_tokens']}, seed {s['seed']})")
    width = max([len(name) for name in result["rewards"]] + [len(f"pass@{k}") for k in result["pass_at_k"]] + [6])
    rows = [head, f"{'reward':<{width}}  {'mean':>8}  {'std':>8}"]
    rows += [f"{name:<{width}}  {v['mean']:>8.4f}  {v['std']:>8.4f}" for name, v in result["rewards"].items()]
    rows += [f"{'pass@' + k:<{width}}  {v:>8.4f}" for k, v in result["pass_at_k"].items()]
    rows.append(f"(a completion passes where its reward >= {result['pass_threshold']:g})")
    return "\n".join(rows)
