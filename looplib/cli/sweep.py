"""What a job of a sweep gives back to its sweeper, and what a trial tells its study as it trains.

    python -m looplib.train -m hydra/sweeper=optuna 'lr=tag(log, interval(1e-4, 1e-2))' \\
        '+precision=choice(fp32,bf16)' hydra.sweeper.n_trials=20 hydra.sweep.dir=multirun/lr

- **The objective.** Every job returns a number to Hydra: the last value of ``sweep.metric``
  (default ``eval_loss``) in its ``metrics.jsonl``. Any Hydra sweeper (looplib's Optuna
  sweeper, Hydra's Ax or Nevergrad sweepers) then receives it. In a sweep, a job that fails
  (an exception, a stop on non-finite steps, a failed save) or whose objective is not finite
  returns NaN, which Optuna records as a failed trial, and the sweep goes on; a refused
  setting (exit 2) and a signal (Ctrl-C, preemption) still stop the whole sweep. Outside a
  sweep the job exits with its status as before.
- **Pruning** (``hydra.sweeper.pruner=median|hyperband``, looplib's Optuna sweeper only). The
  sweeper tells each job its trial (``hydra.sweeper.trial``) and the study's storage; the job
  opens the study there (so a joblib or SLURM launcher's processes report too), and a
  ``TrialReporter`` among the run's loggers reports every value of ``sweep.metric`` (each
  held-out evaluation) to the trial. When the pruner says stop, the run stops the way a
  preemption does (``Signals.stop``): a checkpoint at that step, then the end of the run; the
  trial is marked ``pruned`` in the study and a row ``{"step": N, "pruned": 1}`` closes
  ``metrics.jsonl``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_PREEMPTED, ConfigError
from ..loggers import Logger
from ..run.signals import Signals

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("looplib")

SWEEPER = "hydra_plugins.looplib_optuna.sweeper.OptunaSweeper"  # looplib's Optuna sweeper (hydra/sweeper=optuna)
PRUNED = "pruned by the study"  # Signals.stop's reason
STOPS_THE_SWEEP = (EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_PREEMPTED)  # bad input, Ctrl-C, preemption


SWEEP_RECORD = ("multirun.yaml",)  # what Hydra's sweeper writes into a sweep directory: no result


def forget_sweep(sweep_dir: Path) -> None:
    """A sweep stopped before any job wrote a result leaves no directory behind, where this command
    made it (``looplib.store.lock``: ``made_here``)."""
    from ..store import lock
    from ..store.rundir import forget, results
    path = Path(sweep_dir).absolute()
    if lock.made_here(path) and not results(path, SWEEP_RECORD):
        forget(path, fresh=True)


def in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def no_sample_unless_asked(cfg: "DictConfig") -> None:
    """A sweep's jobs end without the end-of-run sample (``sample_tokens=0``) unless the command
    line sets ``sample_tokens``: a trial is judged by its metric, and the sample would cost every
    trial its seconds. The saved config says 0."""
    from hydra.core.hydra_config import HydraConfig
    if in_sweep() and not any(o.lstrip("+~").partition("=")[0] == "sample_tokens"
                              for o in HydraConfig.get().overrides.task):
        cfg.sample_tokens = 0


def job(execute: Callable[[], int]) -> int:
    """Run the job; in a sweep an unexpected exception is a failed trial (logged with its
    traceback, status 1) instead of the end of the sweep."""
    if not in_sweep():
        return execute()
    try:
        return execute()
    except Exception:  # noqa: BLE001 - one trial's crash must not end the search
        log.exception("this trial failed")
        print("looplib: this trial failed (traceback in its log); the sweep goes on", file=sys.stderr, flush=True)
        return 1


def outcome(cfg, run_dir: Path, status: int, signals: Signals) -> float | None:
    """The job's return value: its objective. Outside a sweep a non-zero status exits the
    process as before; in a sweep only a refused setting or a signal does (the rest: NaN)."""
    sweeping = in_sweep()
    if status and (not sweeping or status in STOPS_THE_SWEEP):
        if sweeping:
            from hydra.core.hydra_config import HydraConfig
            forget_sweep(Path(str(HydraConfig.get().sweep.dir)))  # stopped before any job wrote a result: no directory
        sys.exit(status)
    metric = cfg.get("sweep", {}).get("metric", "eval_loss")
    rows = read_rows(run_dir / "metrics.jsonl")
    if signals.reason == PRUNED and rows:
        with open(run_dir / "metrics.jsonl", "a") as f:  # the run's own files are closed by now
            f.write(json.dumps({"step": rows[-1].get("step", 0), "pruned": 1}) + "\n")
    if status:
        return math.nan
    value = last_value(rows, metric)
    if value is None or not math.isfinite(value):
        if sweeping:
            log.warning("sweep.metric=%s: %s, so this trial counts as failed", metric,
                        f"the last value is {value}" if value is not None else
                        "metrics.jsonl holds no such key (keys: " + ", ".join(sorted({k for r in rows for k in r})) + ")")
        return math.nan if sweeping else value
    return value


def read_rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a row cut short by a kill
                pass
    return rows


def last_value(rows: list[dict], key: str) -> float | None:
    for row in reversed(rows):
        if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool):
            return float(row[key])
    return None


def reporting(cfg) -> list[Logger]:
    """The loggers a job of looplib's Optuna sweeper adds: a ``TrialReporter`` when the sweep
    prunes, on rank 0 only (the only process that touches the study; its decision to prune is
    agreed by every rank at the next step boundary, as a preemption is); none otherwise (a grid
    sweep, a single run, Hydra's other sweepers)."""
    from hydra.core.hydra_config import HydraConfig

    from ..process.launcher import launched_rank
    if not in_sweep() or launched_rank() != 0:
        return []
    sweeper = HydraConfig.get().sweeper
    if sweeper.get("_target_") != SWEEPER or sweeper.get("trial") is None or sweeper.get("pruner") in (None, "none"):
        return []
    metric = cfg.get("sweep", {}).get("metric", "eval_loss")
    return [TrialReporter(sweeper.storage, sweeper.study_name, int(sweeper.trial), metric,
                          sweeper.pruner, dict(sweeper.get("pruner_args") or {}))]


def pruner(name: str, args: dict):
    """``median`` / ``hyperband`` / ``none``: Optuna's pruner with ``pruner_args``."""
    import optuna
    kinds = {"median": optuna.pruners.MedianPruner, "hyperband": optuna.pruners.HyperbandPruner,
             "none": optuna.pruners.NopPruner}
    return kinds[name](**args)


class TrialReporter(Logger):
    """Reports each value of ``metric`` to the trial; stops the run when the pruner says so."""

    def __init__(self, storage: str, study_name: str, trial: int, metric: str, pruner_name: str, pruner_args: dict):
        import optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.load_study(study_name=study_name, storage=storage,
                                       sampler=optuna.samplers.RandomSampler(),  # the job samples nothing
                                       pruner=pruner(pruner_name, pruner_args))
        self.number, self.metric, self.pruned_at = trial, metric, None
        trial_id = next(t._trial_id for t in self.study.get_trials(deepcopy=False) if t.number == trial)
        self.trial = optuna.trial.Trial(self.study, trial_id)  # the sweeper asked it; this process reports to it
        self.trial.set_user_attr("pid", os.getpid())  # which process ran it (a parallel launcher's worker)

    def log(self, row: dict) -> None:
        value = row.get(self.metric)
        if self.pruned_at is not None or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        self.trial.report(float(value), int(row["step"]))
        if self.trial.should_prune():
            self.pruned_at = row["step"]
            log.warning("trial %d pruned at step %d (%s %.4g): checkpoint, then stop", self.number,
                        row["step"], self.metric, value)
            if Signals.current is not None:
                Signals.current.stop(PRUNED)

    def finish(self, status: str, artefacts: dict[str, str]) -> None:
        if self.pruned_at is not None and status == "preempted":
            import optuna
            self.study.tell(self.number, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True)


def grid(overrides) -> list[list[str]]:
    """The jobs of a grid sweep, as Hydra's basic sweeper makes them: each sweep's values (a later
    override of a key replaces an earlier one, in its place), every combination, the first key
    slowest. None at all where an override is not a grid's (``interval(...)``: a sweeper's)."""
    import itertools
    lists: dict[str, list[str]] = {}
    for o in overrides:
        key = o.get_key_element()
        if not o.is_sweep_override():
            lists[key] = [f"{key}={o.get_value_element_as_str()}"]
        elif o.is_discrete_sweep():
            lists[key] = [f"{key}={value}" for value in o.sweep_string_iterator()]
        else:
            return []
    return [list(job) for job in itertools.product(*lists.values())]


def check_sweep_jobs(config: DictConfig, most: int = 256) -> None:
    """Every job of a grid sweep run by Hydra's basic sweeper and launcher, checked as its run will
    check it (every key, then each strategy built: a missing package is refused here) before the
    first job starts, so that ``-m lr=1e-3,-1`` or ``+optim=adamw,adam8bit`` without bitsandbytes
    stops before any job ran, not after the jobs before it. Hydra composes each batch itself (a
    missing option is found then); these checks are looplib's. The first ``most`` jobs."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    from ..groups import strategies
    from .instantiate import check_config, instantiate
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    task = [f"{k}={v}" for k, v in params.items()] + list(OmegaConf.select(config, "hydra.overrides.task") or [])
    jobs = grid(OverridesParser.create().parse_overrides(task))
    for n, job in enumerate(jobs[:most] if len(jobs) > 1 else []):
        try:
            cfg = compose(config_name=OmegaConf.select(config, "hydra.job.config_name"), overrides=job,
                          return_hydra_config=True)
        except Exception:  # noqa: BLE001 - Hydra's own refusal of a job: Hydra says it as the batch starts
            return
        hydra_config, sweep_config = HydraConfig.instance(), HydraConfig.instance().cfg
        hydra_config.set_config(cfg)  # the job's choices, for messages that say which option chose a class
        try:
            with open_dict(cfg):
                del cfg["hydra"]
            settings = check_config(cfg)
            for row in strategies():  # built, not set up: no device is touched
                if cfg.get(row.name) is not None:
                    built = instantiate(cfg, row.name)
                    if row.name == "schedule" and hasattr(built, "check"):
                        built.check(settings.max_steps)  # a warm-up as long as this job's max_steps
        except ConfigError as err:
            raise ConfigError(err.key, f"{err.problem} (in job {n} of the {len(jobs)}: {' '.join(job)})",
                              f"{err.fix}; no job of the sweep has run") from None
        finally:
            hydra_config.cfg = sweep_config
