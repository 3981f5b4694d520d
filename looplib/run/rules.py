"""Which strategies combine with which: every rule between the parts of a job, listed once, in the
order they are asked. Each rule reads the parts (and the settings) and raises the one-line
``ConfigError`` that names the setting and its fix; the strategies keep the knowledge of what they
can do (an engine's ``check``, a schedule's ``check``, a model's ``check_data``), and this list
says which rules exist, when each is asked and what it reads.

    parts    before any data or model exists (nothing is tokenised or built for a refused job)
    built    once the data and the model exist, before anything wraps the model
    chosen   once ``batch_size=auto`` chose the micro-batch and the accumulation (asked at ``parts``
             too when the batch was given)

``python -c "from looplib.run import rules; print(rules.table())"`` prints the list (docs/extending.md
holds it; a test keeps the two equal). A rule of one's own: append a ``Rule`` to ``RULES``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from ..errors import ConfigError
from ..loss import TokenCrossEntropy, refuse_unshifted
from ..reward import NoReward
from . import teacher


@dataclass(frozen=True)
class Rule:
    name: str                                    # what it keeps from happening, in a few words
    stage: Literal["parts", "built", "chosen"]
    reads: str                                   # the parts and settings it reads
    ask: Callable[[Any, Any], None]              # ask(parts, settings): raises ConfigError, or returns


def ask(stage: str, parts: Any, settings: Any) -> None:
    """Every rule of ``stage`` (and at ``parts``, those of ``chosen`` when the batch was given), in order."""
    for rule in RULES:
        if rule.stage == stage or (stage == "parts" and rule.stage == "chosen" and settings.batch_size != "auto"):
            rule.ask(parts, settings)


def optional(obj: Any, verb: str, *args: Any) -> None:
    """``obj.verb(*args)`` where ``obj`` has the verb (a class of one's own may not)."""
    method = getattr(obj, verb, None)
    if method is not None:
        method(*args)


def check_sequences_fit(corpus: Any, model: Any) -> None:
    """A training sample longer than the model's ``seq_len`` would fail in the first forward pass
    (position embeddings run out): refuse it now. Models and data without these are not asked."""
    limit = getattr(model, "seq_len", None)
    try:
        length = corpus.train[0]["input_ids"].shape[-1] if len(corpus.train) else 0
    except (AttributeError, IndexError, KeyError, TypeError):
        return
    if isinstance(limit, int) and length > limit:
        raise ConfigError("data.seq_len", f"the data's sequences hold {length} tokens, more than model.seq_len={limit}",
                          "leave data.seq_len as ${model.seq_len}, or make model.seq_len at least as long")


def check_labels(corpus: Any, objective: Any, samples: int = 8) -> None:
    """Labels in the Hugging Face convention (unshifted) would train a copier: refused on the first
    training samples, before anything is written (``looplib.loss.refuse_unshifted``; every batch is
    checked again as it is counted). Data whose samples are not dicts of ids is not asked."""
    if not isinstance(objective, TokenCrossEntropy):
        return
    try:
        first = [corpus.train[i] for i in range(min(samples, len(corpus.train)))]
    except (AttributeError, IndexError, KeyError, TypeError, NotImplementedError):
        return
    for sample in first:
        if isinstance(sample, dict) and "labels" in sample and "input_ids" in sample:
            try:
                ids, labels = torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["labels"])
            except (TypeError, ValueError, RuntimeError):
                return
            positions = sample.get("position_ids")
            refuse_unshifted(ids, labels, objective.ignore_index,
                             torch.as_tensor(positions) if positions is not None else None)


def check_pairs(corpus: Any, objective: Any) -> None:
    """A preference objective (``loss=dpo``) needs data of pairs, and pairs need such an objective:
    any other would train on the rejected completions as on the chosen ones."""
    wants, has = getattr(objective, "pairs", False), getattr(corpus, "pairs", False)
    if wants and not has:
        raise ConfigError("data", f"the loss ({type(objective).__name__}) trains on pairs of completions (chosen "
                          f"and rejected), and the data ({type(corpus).__name__}) hold none",
                          "use data=preference data.path=PAIRS.jsonl (records with prompt, chosen and rejected)")
    if has and not wants:
        raise ConfigError("loss", f"data=preference holds pairs, and the loss ({type(objective).__name__}) would "
                          "train on the rejected completions as on the chosen ones",
                          "use loss=dpo, loss=simpo or loss=orpo")


def check_rollouts(corpus: Any, objective: Any, reward: Any, batch_size: Any = None) -> None:
    """A rollout objective (``loss=grpo``) samples its completions for ``data=prompts`` and scores them with a
    reward; prompts or a reward without one would be trained on as something else, or ignored. A completion
    of ``max_new_tokens`` must fit after the longest prompt in the model's positions."""
    wants, has = getattr(objective, "rollouts_needed", False), getattr(corpus, "prompts", False)
    scored = reward is not None and not isinstance(reward, NoReward)
    if wants and not has:
        raise ConfigError("data", f"the loss ({type(objective).__name__}) samples completions of prompts, and the data "
                          f"({type(corpus).__name__}) hold none", "use data=prompts data.path=PROMPTS.jsonl")
    if has and not wants:
        raise ConfigError("loss", f"data=prompts holds prompts without completions, and the loss "
                          f"({type(objective).__name__}) would train on the prompts themselves", "use loss=grpo")
    if scored and not wants:
        raise ConfigError("reward", f"a reward is chosen, and the loss ({type(objective).__name__}) samples nothing "
                          "to score: it would be ignored", "use loss=grpo data=prompts, or drop +reward")
    if wants and not scored:
        raise ConfigError("reward", "loss=grpo scores its completions with a reward, and none is chosen",
                          "add +reward=exact_answer (or +reward=format, reward._target_=my_pkg.fn)")
    if wants and batch_size == "auto":
        raise ConfigError("batch_size", "batch_size=auto measures memory on batches of the data, and loss=grpo's "
                          "batches are sampled as it trains (their sizes unknown before)",
                          "give batch_size=N prompts per micro-batch (each with loss.group_size completions)")
    longest, seq_len = getattr(corpus, "longest_prompt", lambda: 0)(), getattr(corpus, "seq_len", None)
    if wants and seq_len and longest + objective.max_new_tokens - 1 > seq_len:
        raise ConfigError("loss.max_new_tokens", f"the longest prompt holds {longest} tokens, and with "
                          f"loss.max_new_tokens={objective.max_new_tokens} its sequences would exceed "
                          f"seq_len={seq_len}",
                          f"use loss.max_new_tokens={max(1, seq_len - longest + 1)} or less, shorter prompts, or a "
                          "longer model.seq_len")


RULES: list[Rule] = [
    Rule("the engine takes the precision and the optimizer (FSDP2 and ZeRO: their own scaling, states)", "parts",
         "engine, precision, optim, settings", lambda p, s: p.engine.check(s, p.precision, p.optim)),
    Rule("the engine evaluates as the evaluation asks (sharded models: every rank)", "parts",
         "engine, evaluation", lambda p, s: p.engine.check_evaluation(p.evaluation)),
    Rule("activation memory under the engine and compile (offload: not under CUDA graphs)", "parts",
         "checkpointing, engine, compile", lambda p, s: p.checkpointing.check(p.engine, p.compile)),
    Rule("a compiled optimizer step needs foreach kernels, not fused ones", "parts",
         "compile, optim, engine.device", lambda p, s: p.compile.check_optimizer(p.optim, p.engine.device)),
    Rule("CUDA graphs: one backward per step (no accumulation)", "chosen",
         "compile, accum_steps", lambda p, s: p.compile.check_accumulation(s.accum_steps)),
    Rule("a warm-up shorter than the run", "parts",
         "schedule, max_steps", lambda p, s: optional(p.schedule, "check", s.max_steps)),
    Rule("the adapter on the engine and precision (QLoRA: an engine that keeps the 4-bit base)", "parts",
         "peft, engine, precision", lambda p, s: p.peft.check(p.engine, p.precision)),
    Rule("the optimizer with the adapter and the engine (Muon: no LoRA)", "parts",
         "optim, engine, peft", lambda p, s: optional(p.optim, "check", p.engine, p.peft)),
    Rule("fixed shapes under CUDA graphs (no padded batches)", "built",
         "compile, data", lambda p, s: p.compile.check(p.data)),
    Rule("the data as the model reads it (a transformers model's vocabulary, positions)", "built",
         "model, data", lambda p, s: optional(p.model, "check_data", p.data)),
    Rule("sequences no longer than the model's positions", "built",
         "data, model", lambda p, s: check_sequences_fit(p.data, p.model)),
    Rule("pairs of completions with a preference loss, and only with one", "built",
         "data, objective", lambda p, s: check_pairs(p.data, p.objective)),
    Rule("prompts with a rollout loss and a reward, and each only with the others (completions that fit)", "built",
         "data, objective, reward", lambda p, s: check_rollouts(p.data, p.objective, p.reward,
                                                                          s.batch_size)),
    Rule("labels shifted as the loss expects (not the Hugging Face convention)", "built",
         "data, objective", lambda p, s: check_labels(p.data, p.objective)),
    Rule("the objective's own check of the data and the model, its teacher read first (loss=distill: the "
         "teacher's vocabulary and tokenizer)", "built", "objective, data, model, engine", lambda p, s: (
             teacher.provide(p.objective, p.data, p.model, p.engine),
             optional(p.objective, "check_data", p.data, p.model, p.engine))),
    Rule("adapters on a trained base (unless peft.allow_random_base)", "built",
         "peft, model", lambda p, s: optional(p.peft, "check_base", p.model)),
]


def table() -> str:
    """The rules as a markdown table (docs/extending.md)."""
    rows = ["| # | rule | asked | reads |", "|---|---|---|---|"]
    rows += [f"| {i} | {r.name} | {r.stage} | {r.reads} |" for i, r in enumerate(RULES, 1)]
    return "\n".join(rows)
