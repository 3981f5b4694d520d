"""Evaluate a finished run: ``python -m looplib.evaluate RUN data=prompts data.path=FILE +reward=NAME
[n=8 k=1,4 max_new_tokens=64 temperature=1.0 top_p=1.0 seed=0 threshold=1] [--out PATH] [--samples]``,
or ``python -m looplib.evaluate RUN --lm-eval TASKS [--tasks NAME,...]``.

The arguments only: the run is loaded by ``looplib.store.finished.load_finished`` (as
``python -m looplib.generate`` loads it: a transformers run's ``hf/``, a bundled model's
``config.yaml`` + ``model.safetensors``, a run stopped early through its newest checkpoint), the
sampling and the numbers are ``looplib.evaluation_rewards``'s, the harness ``looplib.harness``'s.

- ``data.*`` and ``reward.*`` are composed from looplib's conf/ as training composes them (Hydra's
  compose API): ``data=prompts data.path=held_out.jsonl``, ``+reward=exact_answer``,
  ``+reward=format reward.pattern=...``, ``+reward._target_=my_pkg.my_reward``. The prompts are
  tokenised by the run's own tokenizer (``data.tokenizer``, ``data.vocab_size`` and
  ``data.seq_len`` are the run's: giving them is refused); every record is evaluated, or, with
  ``data.eval_path`` or ``data.eval_fraction`` given, the held-out split alone (the one training
  held out, with the same ``data.seed``).
- ``n`` (4) completions per prompt, ``k`` (``1`` and ``n``) the pass@k to report, ``threshold`` (1):
  the reward at which a completion passes; ``max_new_tokens`` (64), ``temperature`` (1.0),
  ``top_p`` (1.0), ``seed`` (0) as ``loss.*`` and ``seed`` in training.
- The record goes to ``RUN/eval/rewards-<data file's stem>.json`` (``--out PATH``: there), and with
  ``--samples`` every completion beside it (``.samples.jsonl``). A file there that holds another
  evaluation (another run, data, reward, sampling, k or threshold) is never replaced: refused in
  one line (give ``--out``); the same evaluation's file is rewritten.

Bad input (not a run, no reward, data other than prompts, a k above n, a classifier, a reward
that breaks its contract): one line, exit status 2, nothing written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path

import torch

from ..atomic import write_atomic
from ..errors import EXIT_CONFIG, ConfigError
from ..evaluation_rewards import Sampling, evaluate, samples, summary, table
from ..store.finished import Finished, hf_directory, load_finished, newest_checkpoint

COMMAND = "python -m looplib.evaluate"
FROM_THE_RUN = ("data.tokenizer", "data.vocab_size", "data.seq_len")  # the run's own: never given
KIND = "looplib.evaluate rewards"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is looplib's one-line error (exit 2), not a usage screen."""

    def error(self, message: str):
        flag = message.split("argument ")[-1].split(":")[0] if "argument " in message else "arguments"
        raise ConfigError(flag.split("/")[0], " ".join(message.split()), f"see {COMMAND} --help")


def parser() -> OneLineParser:
    p = OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0],
                      epilog="Other arguments: data.*/reward.* overrides and n=, k=, max_new_tokens=, temperature=, "
                             "top_p=, seed=, threshold= (docs/post-training.md#evaluate).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or one of its checkpoints, or a transformers "
                                                  "model directory)")
    p.add_argument("--out", default=None, help="the JSON record's path (default RUN/eval/rewards-<data>.json, "
                                               "RUN/eval/lm-eval-<tasks>.json)")
    p.add_argument("--samples", action="store_true", help="also write every completion (JSONL beside the record)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--lm-eval", dest="lm_eval", default=None, metavar="TASKS",
                   help="run lm-evaluation-harness on local task configs (a YAML file or a directory of them)")
    p.add_argument("--tasks", default=None, help="with --lm-eval: the task names to run, comma-separated "
                                                 "(default: every task the YAML files define)")
    p.add_argument("--limit", type=int, default=None, help="with --lm-eval: at most this many documents per task")
    return p


def number_list(key: str, value: str) -> list[int]:
    try:
        ks = [int(v) for v in value.strip("[]").split(",") if v.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ConfigError(key, f"{key}={value} is not a list of positive whole numbers", f"write e.g. {key}=1,4")
    return sorted(set(ks))


def settings(args: list[str]) -> tuple[Sampling, list[int] | None, float, list[str]]:
    """(the sampling, the k's, the threshold, the data and reward overrides) from the arguments."""
    types = {f.name: f.type for f in fields(Sampling)}
    values, ks, threshold, overrides = {}, None, 1.0, []
    for arg in args:
        key, eq, value = arg.partition("=")
        bare = key.lstrip("+~")
        if eq and bare in types:
            try:
                values[bare] = {"int": int, "float": float}[types[bare]](value)
            except ValueError:
                raise ConfigError(bare, f"{bare}={value} is not a number",
                                  f"write e.g. {bare}={getattr(Sampling(), bare)}") from None
        elif eq and bare == "k":
            ks = number_list("k", value)
        elif eq and bare == "threshold":
            try:
                threshold = float(value)
            except ValueError:
                raise ConfigError("threshold", f"threshold={value} is not a number", "write e.g. threshold=1") from None
        elif bare.split("=")[0].split(".")[0] in ("data", "reward"):
            if bare.split("=")[0] in FROM_THE_RUN:
                raise ConfigError(bare.split("=")[0], "the prompts are tokenised as the run's model reads them: its "
                                  "tokenizer, vocabulary and sequence length are the run's", f"drop {arg}")
            overrides.append(arg)
        else:
            raise ConfigError(bare.split("=")[0] or arg, f"{arg} is not a setting of {COMMAND}",
                              "give data.*, reward.* (as in training), n, k, max_new_tokens, temperature, top_p, "
                              "seed, threshold, or --lm-eval")
    s = Sampling(**values)
    if s.n < 1 or s.max_new_tokens < 1:
        raise ConfigError("n" if s.n < 1 else "max_new_tokens", "n and max_new_tokens must be at least 1",
                          "e.g. n=8 max_new_tokens=64")
    if not s.temperature > 0 or not 0 < s.top_p <= 1:
        raise ConfigError("temperature" if not s.temperature > 0 else "top_p",
                          f"temperature must be positive and top_p in (0, 1] (got {s.temperature}, {s.top_p})",
                          "e.g. temperature=1.0 top_p=1.0")
    return s, ks, threshold, overrides


def compose(overrides: list[str]):
    """looplib's config composed with the data and reward overrides, as ``python -m looplib.train``
    composes it (both spellings of a group; the ``+`` of each key decided by whether the config
    has it, ``looplib.cli.args.settle``)."""
    from hydra import compose as hydra_compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from .args import Refusal, explain, settle
    from .resolvers import register_resolvers
    register_resolvers()
    try:
        job = settle(list(overrides))
        with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
            return hydra_compose(config_name="config", overrides=job)
    except (Refusal, HydraException, OmegaConfBaseException) as err:
        line = err.line if isinstance(err, Refusal) else explain(err)
        key, _, problem = line.partition(": ")
        problem, _, fix = problem.partition("; ")
        raise ConfigError(key, problem, fix or "give data.* and reward.* as python -m looplib.train takes them") \
            from None


def chosen_reward(cfg):
    """The reward the overrides chose, built (refused: none chosen)."""
    from .instantiate import check_group, functions_as_given, instantiate, resolved
    from ..reward import NoReward
    node = cfg.get("reward")
    target = node.get("_target_") if node is not None else None
    if target is None or str(target).endswith(NoReward.__name__):
        raise ConfigError("reward", "no reward was chosen: nothing scores the completions",
                          "add +reward=exact_answer (or +reward=format, +reward._target_=my_pkg.my_reward)")
    functions_as_given(cfg)
    check_group(cfg, "reward")
    return instantiate(cfg, "reward"), resolved(cfg, "reward")


def prompts_class(cfg):
    from .instantiate import locate, resolved
    target = resolved(cfg, "data").get("_target_")
    cls = locate("data", target)
    if not getattr(cls, "prompts", False):
        raise ConfigError("data", f"the data ({target}) hold no prompts to sample completions for",
                          "use data=prompts data.path=PROMPTS.jsonl")
    return cls


def run_tokenizer(done: Finished, stack: ExitStack) -> str:
    """Where the run's tokenizer is, as ``data.tokenizer`` takes it: a transformers run's own
    directory; a bundled model's data tokenizer (the one it was given, or the one it trained: the
    checkpoint's copy, else the run's data rebuilt from the cache, written to a temporary file)."""
    if done.tokenizer is not None:
        return str(hf_directory(done.run_dir) or done.run_dir)
    given = (done.config.get("data") or {}).get("tokenizer")
    if given and Path(str(given)).expanduser().exists():
        return str(given)
    from ..data.identity import TOKENIZER_FILE
    checkpoint = done.checkpoint or newest_checkpoint(done.run_dir)
    if checkpoint is not None and (checkpoint / TOKENIZER_FILE).is_file():
        return str(checkpoint / TOKENIZER_FILE)
    corpus = done.corpus()
    tokenizer = getattr(corpus, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "to_str"):
        raise ConfigError("RUN_DIR", f"{done.run_dir}'s data had no tokenizer (e.g. data=random): its model reads no text",
                          "evaluate a run trained on text")
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="looplib-evaluate-")))
    (folder / TOKENIZER_FILE).write_text(tokenizer.to_str())
    return str(folder / TOKENIZER_FILE)


def positions(done: Finished) -> int | None:
    """The model's positions (the run's ``data.seq_len``, else a transformers config's), or None."""
    for node in (done.config.get("data") or {}, done.config.get("model") or {}):
        if isinstance(node.get("seq_len"), int):
            return node["seq_len"]
    config = getattr(done.model, "config", None)
    found = getattr(config, "max_position_embeddings", None)
    return found if isinstance(found, int) else None


class Logits(torch.nn.Module):
    """A transformers causal LM as looplib's sampler calls a model: ``model(ids) -> logits``."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits


def language_model(done: Finished):
    """The run's model as the sampler calls it; a classifier is refused."""
    if done.classifier or (done.tokenizer is None and not hasattr(done.model, "generate")):
        raise ConfigError("RUN_DIR", f"{done.run_dir} holds a classifier ({type(done.model).__name__}): it samples no "
                          "text to score", "evaluate a language model's run (its held-out accuracy is in metrics.jsonl)")
    return Logits(done.model) if done.tokenizer is not None else done.model


def run_identity(done: Finished) -> dict:
    """Which weights were evaluated: the run, what was loaded, its weight files' sizes and times."""
    loaded = done.checkpoint or hf_directory(done.run_dir) or done.run_dir
    files = sorted(p for p in Path(loaded).iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    return {"dir": str(Path(done.run_dir).resolve()), "loaded": str(Path(loaded).resolve()),
            "weights": [{"file": p.name, "bytes": p.stat().st_size, "modified_ns": p.stat().st_mtime_ns} for p in files]}


def output_path(run_dir: Path, out: str | None, name: str) -> Path:
    return Path(out) if out else run_dir / "eval" / f"{name}.json"


def check_free(path: Path, evaluation: dict) -> None:
    """``path`` holds nothing, or this same evaluation (rewritten); anything else is refused."""
    if not path.exists():
        return
    try:
        before = json.loads(path.read_text())
        previous = before["evaluation"] if before.get("kind") == evaluation["kind"] else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        previous = None
    if previous == evaluation:
        return
    if previous is None:
        raise ConfigError("--out", f"{path} exists and is not a record of this kind of evaluation",
                          "give another --out PATH, or move the file away")
    differs = next(k for k in sorted(set(previous) | set(evaluation)) if previous.get(k) != evaluation.get(k))
    raise ConfigError("--out", f"{path} holds another evaluation (its {differs} differs): it is not replaced",
                      "give --out PATH for this one, or move the file away")


def write(path: Path, record: dict, extra: tuple[Path, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if extra is not None:
        write_atomic(extra[0], extra[1])
    write_atomic(path, json.dumps(record, indent=2) + "\n")


def rewards_main(args, rest: list[str], device: torch.device) -> int:
    from omegaconf import open_dict
    from .instantiate import check_group, instantiate, resolved
    from ..data.tokenizer import load_tokenizer
    from ..reward import name_of
    s, ks, threshold, overrides = settings(rest)
    ks = ks or sorted({1, s.n})
    if max(ks) > s.n:
        raise ConfigError("k", f"pass@{max(ks)} needs at least {max(ks)} completions per prompt, and n={s.n}",
                          f"use n={max(ks)} or more, or k={','.join(str(k) for k in ks if k <= s.n) or 1}")
    cfg = compose(overrides)
    reward, reward_config = chosen_reward(cfg)
    prompts_class(cfg)
    asked = {o.lstrip("+~").split("=")[0] for o in overrides}  # a held-out split asked for: it alone
    held_out = bool(resolved(cfg, "data").get("eval_path")) or (
        "data.eval_fraction" in asked and float(resolved(cfg, "data").get("eval_fraction") or 0) > 0)
    done = load_finished(Path(args.run_dir), device)
    model = language_model(done)
    if done.checkpoint is not None and done.checkpoint != Path(args.run_dir):
        print(f"looplib: {args.run_dir} was stopped before its end: evaluating its newest checkpoint, "
              f"{done.checkpoint}", file=sys.stderr, flush=True)
    with ExitStack() as stack:
        with open_dict(cfg):
            cfg.data.tokenizer = run_tokenizer(done, stack)
            cfg.data.vocab_size = load_tokenizer(cfg.data.tokenizer, "RUN_DIR").vocab_size
            cfg.data.seq_len = positions(done) or 1 << 20
            if not held_out:
                cfg.data.eval_fraction = 0
        check_group(cfg, "data")
        corpus = instantiate(cfg, "data")
        data_config = resolved(cfg, "data")
    examples = corpus.eval if held_out else corpus.train
    if len(examples) == 0:
        raise ConfigError("data.path", "no prompt to evaluate (the held-out split is empty)",
                          "give data.eval_path=FILE, a larger data.eval_fraction, or leave both out (every record)")
    seq_len = positions(done)
    if seq_len and examples.longest() + s.max_new_tokens - 1 > seq_len:
        raise ConfigError("max_new_tokens", f"the longest prompt holds {examples.longest()} tokens, and with "
                          f"max_new_tokens={s.max_new_tokens} its sequences would exceed the model's {seq_len} "
                          "positions", f"use max_new_tokens={max(1, seq_len - examples.longest() + 1)} or less")
    files = [str(Path(p).resolve()) for p in corpus.files]
    identity = {part: value.get("digest") if isinstance(value, dict) else value  # (not where the files lie)
                for part, value in (corpus.fingerprint() or {}).items()}
    settings_of_data = {k: v for k, v in data_config.items() if k not in ("tokenizer", "path", "eval_path")}
    evaluation = {"kind": KIND, "run": run_identity(done),
                  "data": {"files": files, "split": "held-out" if held_out else "all", "identity": identity,
                           "config": settings_of_data},
                  "reward": reward_config, "sampling": vars(s), "k": ks, "threshold": threshold}
    out = output_path(Path(done.run_dir), args.out, f"rewards-{Path(files[0]).stem}")
    check_free(out, evaluation)
    start = time.perf_counter()
    name = name_of(reward)
    try:
        found = evaluate(model, examples, reward, s, corpus.decode, corpus.eos_id, device,
                         getattr(corpus, "prompt_field", "prompt"))
    except ConfigError as err:  # a reward that broke its contract: said as training says it, for an evaluation
        raise ConfigError(err.key, err.problem.replace("nothing was trained on this batch", "nothing was written"),
                          err.fix) from None
    numbers = summary(found, s, ks, threshold, name)
    field = getattr(corpus, "prompt_field", "prompt")
    record = {"kind": KIND, **numbers, "seconds": round(time.perf_counter() - start, 3),
              "command": " ".join([COMMAND, *sys.argv[1:]]) if sys.argv[1:] else COMMAND,
              "evaluation": evaluation}
    extra = None
    if args.samples:
        extra = (out.with_name(out.stem + ".samples.jsonl"),
                 samples(found, threshold, lambda index: examples.record(index).get(field)))
    write(out, record, extra)
    print(table(numbers))
    print(f"written: {out}" + (f" and {extra[0]}" if extra else ""))
    return 0


def harness_main(args, rest: list[str], device: torch.device) -> int:
    from ..data.tokenizer import load_tokenizer
    from ..harness import evaluate_tasks, harness_lm, import_lm_eval, results_table
    if rest:
        raise ConfigError(rest[0].split("=")[0], f"--lm-eval runs the harness's own tasks: {rest[0]} has no meaning "
                          "there", "evaluate rewards and run the harness in two commands")
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit", f"--limit must be at least 1 (got {args.limit})", "e.g. --limit 100")
    import_lm_eval()  # refused here, naming the extra, before the model loads
    tasks_path = Path(args.lm_eval).resolve()
    if not tasks_path.exists():
        raise ConfigError("--lm-eval", f"{args.lm_eval} does not exist", "give a task YAML file or a directory of them")
    done = load_finished(Path(args.run_dir), device)
    model = language_model(done)
    names = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    evaluation = {"kind": "looplib.evaluate lm-eval", "run": run_identity(done),
                  "tasks": {"path": str(tasks_path), "names": names, "limit": args.limit}}
    out = output_path(Path(done.run_dir), args.out, f"lm-eval-{'-'.join(names) or tasks_path.stem}").resolve()
    start = time.perf_counter()
    with ExitStack() as stack:
        info = load_tokenizer(run_tokenizer(done, stack), "RUN_DIR")
    lm = harness_lm(model, info, positions(done) or 2048, device)
    results = evaluate_tasks(lm, tasks_path, names, args.limit, before=lambda: check_free(out, evaluation))
    record = {"kind": evaluation["kind"], **results, "seconds": round(time.perf_counter() - start, 3),
              "command": " ".join([COMMAND, *sys.argv[1:]]), "evaluation": evaluation}
    write(out, record)
    print(results_table(results))
    print(f"written: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args, rest = parser().parse_known_args(argv)
        flags = [a for a in rest if a.startswith("-")]
        if flags:
            raise ConfigError(flags[0], f"is not an option of {COMMAND}", f"see {COMMAND} --help")
        from ..engines.local import resolve_device
        device = resolve_device(args.device)
        if not Path(args.run_dir).is_dir():
            raise ConfigError("RUN_DIR", f"{args.run_dir} is not a directory", "give a run directory (outputs/DATE/TIME)")
        if args.lm_eval is None and (args.tasks or args.limit is not None):
            raise ConfigError("--tasks", "--tasks and --limit choose the harness's tasks", "add --lm-eval TASKS")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return (harness_main if args.lm_eval is not None else rewards_main)(args, rest, device)
    except ConfigError as err:
        print(f"looplib: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
