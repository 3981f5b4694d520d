"""Rewards a program can check (the ``reward`` group), for ``loss=grpo``.

A reward is any callable ``reward(prompts, completions, records) -> list[float]``: one number per
completion, the three lists aligned (``prompts[i]`` as the record wrote it, text or messages;
``completions[i]`` the sampled text; ``records[i]`` the whole record, every field untouched).
Chosen like every group:

    +reward=exact_answer                       the final number or \\boxed{} answer equals the record's
    +reward=format  reward.pattern='<answer>'  the completion keeps a required format (a regex)
    +reward=exact_and_format                   several, weighted (``Weighted``)
    +reward._target_=my_pkg.my_reward          a function of one's own (extra keys: its keyword arguments)

``score`` calls it and holds it to its contract: a reward that raises, returns NaN or a count
other than the completions' stops the run with one line naming the reward and the prompt
(``ConfigError``: exit status 2), before the window that asked for it trains on anything.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch

from .errors import ConfigError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class Reward:
    """What the built-in rewards share: a ``weight`` (used by ``Weighted``) and a name for messages."""

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, prompts: list, completions: list[str], records: list[dict]) -> list[float]:
        raise NotImplementedError


class NoReward(Reward):
    """No reward chosen (the group's absent object): a rollout objective refuses to start without one."""

    def __call__(self, prompts, completions, records):
        raise ConfigError("reward", "no reward was chosen", "add +reward=exact_answer (or reward._target_=...)")


class ExactAnswer(Reward):
    """``+reward=exact_answer``: 1.0 where the completion's answer equals the record's ``field``, else 0.

    The completion's answer is the content of its last ``\\boxed{...}``, or else its last number;
    numbers compare as numbers (``1,000`` = ``1000.0``), anything else as stripped text. Example
    record: ``{"prompt": "What is 2 + 3?", "answer": "5"}``, completion ``"2 + 3 = 5"`` -> 1.0."""

    def __init__(self, field: str = "answer", weight: float = 1.0):
        super().__init__(weight)
        self.field = field

    def __call__(self, prompts, completions, records):
        out = []
        for completion, record in zip(completions, records):
            if self.field not in record:
                raise KeyError(f"the record has no field {self.field!r} (fields: {', '.join(map(str, record))}); "
                               f"set reward.field")
            out.append(float(same_answer(final_answer(completion), str(record[self.field]))))
        return out


class Format(Reward):
    """``+reward=format``: 1.0 where the completion matches ``pattern`` (``re.search``; ``full``:
    the whole completion must match, ``re.fullmatch``, DOTALL), else 0. Example: ``pattern:
    '<answer>.*</answer>'``, completion ``"<answer>5</answer>"`` -> 1.0, ``"5"`` -> 0.0."""

    def __init__(self, pattern: str, full: bool = False, weight: float = 1.0):
        super().__init__(weight)
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ConfigError("reward.pattern", f"reward.pattern={pattern!r} is not a regular expression ({err})",
                              "write a Python regular expression") from None
        self.full = full

    def __call__(self, prompts, completions, records):
        match = self.regex.fullmatch if self.full else self.regex.search
        return [float(match(c) is not None) for c in completions]


class Weighted(Reward):
    """Several rewards, summed with their weights: ``rewards`` maps a name to a reward (a built-in
    with its ``weight``, or a function: ``{_target_: my_pkg.fn, _partial_: true}``, weight 1 unless
    ``weights`` says)."""

    def __init__(self, rewards: dict[str, Any], weights: dict[str, float] | None = None):
        super().__init__(1.0)
        if not rewards:
            raise ConfigError("reward.rewards", "reward=weighted names no reward", "add reward.rewards.NAME=...")
        self.rewards, self.weights = dict(rewards), dict(weights or {})
        unknown = sorted(set(self.weights) - set(self.rewards))
        if unknown:
            raise ConfigError("reward.weights", f"reward.weights names {', '.join(unknown)}, which reward.rewards "
                              "does not hold", f"use the names of reward.rewards: {', '.join(self.rewards)}")

    def parts(self) -> list[tuple[str, Callable, float]]:
        return [(name, fn, float(self.weights.get(name, getattr(fn, "weight", 1.0))))
                for name, fn in self.rewards.items()]


def final_answer(text: str) -> str:
    """The content of the last ``\\boxed{...}`` (braces balanced), else the last number, else ''."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def same_answer(got: str, want: str) -> bool:
    def number(s):
        try:
            return float(s.replace(",", "").strip().rstrip("."))
        except ValueError:
            return None
    a, b = number(got), number(want)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=0, abs_tol=1e-9)
    return got.strip() != "" and got.strip() == want.strip()


def name_of(fn) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    if getattr(fn, "name", None):
        return fn.name
    if hasattr(inner, "__qualname__"):
        return f"{inner.__module__}.{inner.__qualname__}" if getattr(inner, "__module__", None) else inner.__qualname__
    return type(fn).__name__


def score(reward, prompts: list, completions: list[str], records: list[dict], sums: dict | None = None) -> torch.Tensor:
    """The rewards of the completions (float64, one per completion): ``Weighted``'s weighted sum,
    or the one reward's; refused in one line where a reward breaks its contract (the module).
    ``sums``: each of a ``Weighted``'s rewards adds ``[sum, sum of squares, count]`` (unweighted) under its name."""
    parts = reward.parts() if isinstance(reward, Weighted) else [(name_of(reward), reward, 1.0)]
    total = torch.zeros(len(completions), dtype=torch.float64)
    for name, fn, weight in parts:
        values = checked(name, fn, prompts, completions, records)
        total += weight * values
        if sums is not None and len(parts) > 1:
            before = sums.get(name, [0.0, 0.0, 0.0])
            sums[name] = [before[0] + values.sum().item(), before[1] + (values ** 2).sum().item(),
                          before[2] + len(values)]
    return total


def checked(name: str, fn, prompts, completions, records) -> torch.Tensor:
    def refuse(problem: str, at: int = 0):
        prompt = " ".join(str(prompts[at]).split()) if prompts else ""
        prompt = prompt if len(prompt) <= 80 else prompt[:77] + "..."
        raise ConfigError("reward", f"the reward {name} {problem} (prompt {prompt!r}); nothing was trained on "
                          "this batch", "fix the reward (it must return one finite number per completion)")
    try:
        values = fn(prompts, completions, records)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - a reward of the user's own: any failure is said in one line
        refuse(f"raised {type(err).__name__}: {' '.join(str(err).split())}")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        refuse(f"returned {type(values).__name__}, not a list of numbers")
    if len(values) != len(completions):
        refuse(f"returned {len(values)} values for {len(completions)} completions")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        refuse(f"returned {values[bad]} for completion {bad}", bad)
    return torch.tensor(values, dtype=torch.float64)
