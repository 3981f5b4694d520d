"""EleutherAI's lm-evaluation-harness on a finished model, with tasks given as local files:
``python -m looplib.evaluate RUN --lm-eval TASKS [--tasks NAME,...]`` (``pip install 'looplib[eval]'``).

``TASKS`` is a task config (YAML, the harness's own format) or a directory of them; their data
are local files (``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``; a relative
data file is relative to the YAML's directory, where the harness runs). Nothing is downloaded: the harness and ``datasets``
run offline, and the harness's built-in tasks are not loaded (only ``TASKS``).

The model is the harness's ``lm_eval.api.model.LM`` as ``LooplibLM`` implements it over
looplib's own call, ``model(ids) -> logits``, for a bundled GPT and a transformers model alike,
and the run's tokenizer (``looplib.data.tokenizer.TokenizerInfo``):

- ``loglikelihood``: the continuation's summed log-probability after the context, and whether
  greedy decoding gives it; the pair is tokenised as the harness's own models do (trailing spaces
  of the context moved to the continuation, the whole encoded, the context's ids split off);
  an empty context is the tokenizer's BOS (else its end-of-text token);
- ``loglikelihood_rolling``: the text's log-probability in windows of the model's positions
  (the harness's ``get_rolling_token_windows``);
- ``generate_until``: greedy tokens until a stop string, the end-of-text token or ``max_gen_toks``.

Requests are scored one sequence at a time (exact: no padding enters any logit).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch

from .errors import ConfigError, need

log = logging.getLogger("looplib")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def import_lm_eval():
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    return need("lm_eval", "eval", "--lm-eval", "python -m looplib.evaluate --lm-eval")


def harness_lm(model, info, max_length: int, device: torch.device):
    """An ``lm_eval.api.model.LM`` over ``model(ids) -> logits`` and the tokenizer ``info``."""
    import_lm_eval()
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class LooplibLM(LM):
        def __init__(self):
            super().__init__()
            self.model, self.info, self.max_length, self.device_ = model, info, max_length, device
            start = info.prefix[-1:] or ([info.eos_id] if info.eos_id is not None else [])
            if not start:
                raise ConfigError("--lm-eval", "the run's tokenizer has neither a BOS nor an end-of-text token to "
                                  "start a text with", "evaluate a model whose tokenizer has one")
            self.start = start[0]

        def encode(self, text: str) -> list[int]:
            return self.info.tokenizer.encode(text, add_special_tokens=False).ids

        def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            if not context:
                return [self.start], self.encode(continuation)
            whole, head = self.encode(context + continuation), self.encode(context)
            return head, whole[len(head):]

        @torch.no_grad()
        def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
            ids = (context + continuation)[-(self.max_length + 1):][:-1]
            logits = self.model(torch.tensor([ids], device=self.device_))[0, -len(continuation):].float()
            logp = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(continuation, device=logp.device)
            return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return [self.score(*self.pair(*r.args)) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            out = []
            for r in requests:
                windows = map(make_disjoint_window, get_rolling_token_windows(
                    self.encode(r.args[0]), self.start, self.max_length, 1))
                out.append(sum(self.score(c, t)[0] for c, t in windows))
            return out

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for r in requests:
                context, kwargs = r.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                budget = int(kwargs.get("max_gen_toks", 256))
                ids = self.encode(context) or [self.start]
                new: list[int] = []
                text = ""
                for _ in range(budget):
                    window = (ids + new)[-self.max_length:]
                    token = int(self.model(torch.tensor([window], device=self.device_))[0, -1].argmax())
                    if token == self.info.eos_id:
                        break
                    new.append(token)
                    text = self.info.tokenizer.decode(new)
                    if any(u and u in text for u in until):
                        break
                cut = min([text.index(u) for u in until if u and u in text] or [len(text)])
                out.append(text[:cut])
            return out

    return LooplibLM()


def task_configs(path: Path, names: list[str]):
    """(the harness's task manager over ``path`` alone, the task names to run): every task the
    YAML files at ``path`` define, or those of ``names`` (each refused unless one of them)."""
    from lm_eval.tasks import TaskManager
    folder = path.parent if path.is_file() else path
    try:
        manager = TaskManager(include_path=str(folder), include_defaults=False)
    except Exception as err:  # noqa: BLE001 - yaml, an !function that does not import
        raise ConfigError("--lm-eval", f"the task configs in {folder} do not load ({' '.join(str(err).split())[:200]})",
                          "give lm-evaluation-harness task YAML files") from None
    index = manager.task_index
    defined = [n for n in manager.all_tasks if not path.is_file() or Path(index[n].yaml_path).resolve() == path.resolve()]
    if not defined:
        raise ConfigError("--lm-eval", f"{path} defines no task (no YAML with a `task:` name)",
                          "give a task YAML file or a directory of them")
    unknown = [n for n in names if n not in defined]
    if unknown:
        raise ConfigError("--tasks", f"{unknown[0]} is not a task of {path} (it defines {', '.join(defined)})",
                          "give --tasks with names the YAML files define")
    return manager, names or defined


def evaluate_tasks(lm, path: Path, names: list[str], limit: int | None, before: Callable[[], None] = lambda: None,
                   ) -> dict:
    """The harness's ``simple_evaluate`` on the tasks at ``path`` (only those), ``limit``
    documents each; ``before()`` is called once the tasks are known to load, before any scoring.
    Returns the harness's ``results`` (per task: its metrics) and the versions and n-shot."""
    lm_eval = import_lm_eval()
    manager, tasks = task_configs(path, names)
    here = Path.cwd()
    os.chdir(path.parent if path.is_file() else path)  # the harness reads relative data files from the working directory
    try:
        try:
            before()
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                          log_samples=False, bootstrap_iters=1000, random_seed=0, numpy_random_seed=0,
                                          torch_random_seed=0, fewshot_random_seed=0)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - a task whose data do not load, a metric that fails
            raise ConfigError("--lm-eval", f"the harness could not run {', '.join(tasks)}: "
                              f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
                              "check the task YAML and its local data files") from None
    finally:
        os.chdir(here)
    return {"results": jsonable(out["results"]), "versions": jsonable(out.get("versions", {})),
            "n-shot": jsonable(out.get("n-shot", {})), "lm_eval": lm_eval.__version__}


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) or value is None or isinstance(value, (int, str, bool)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def results_table(found: dict) -> str:
    """One row per task and metric: its value (and standard error where the harness gives one)."""
    rows = [f"{'task':<24} {'metric':<16} {'value':>8}  {'stderr':>8}"]
    for task, metrics in found["results"].items():
        for key, value in metrics.items():
            metric, comma, kind = key.partition(",")
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            err = metrics.get(f"{metric}_stderr,{kind}")
            err = f"{err:>8.4f}" if isinstance(err, (int, float)) else f"{'':>8}"
            rows.append(f"{task:<24} {metric:<16} {value:>8.4f}  {err}")
    return "\n".join(rows)
