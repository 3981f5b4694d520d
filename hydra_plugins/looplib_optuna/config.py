"""``hydra/sweeper=optuna``: looplib's Optuna sweeper's settings (``hydra.sweeper.*``), with the
keys and search-space syntax of Hydra's own Optuna sweeper, on Optuna >= 4.

Registered in Hydra's ConfigStore when Hydra scans its plugins; nothing here imports Optuna
(that happens only when the sweeper runs: ``pip install 'looplib[optuna]'``).
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TPE:
    """``hydra/sweeper/sampler=tpe`` (the default): optuna.samplers.TPESampler."""
    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False


@dataclass
class Random:
    """``hydra/sweeper/sampler=random``: optuna.samplers.RandomSampler."""
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class Grid:
    """``hydra/sweeper/sampler=grid``: every point of the search space's choice() and range()
    once (n_trials becomes at most their product)."""
    _target_: str = "optuna.samplers.GridSampler"
    seed: Optional[int] = None


@dataclass
class CmaEs:
    """``hydra/sweeper/sampler=cmaes``: optuna.samplers.CmaEsSampler (needs ``pip install cmaes``)."""
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Optional[int] = None
    sigma0: Optional[float] = None
    n_startup_trials: int = 1


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.looplib_optuna.sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sampler is built by the sweeper, once Optuna is known to import
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING    # hydra/sweeper/sampler=tpe|random|grid|cmaes (defaults above)
    # null: looplib's sweep.direction (minimize, or maximize); minimize | maximize
    direction: Optional[str] = None
    # null: SQLite in the sweep directory (sqlite:///<hydra.sweep.dir>/study.db), so that running the
    # same command again continues the study; or any Optuna storage URL
    storage: Optional[str] = None
    study_name: Optional[str] = None  # null: "looplib"
    n_trials: int = 20                # trials the study holds when the sweep ends (finished ones count)
    n_jobs: int = 1                   # trials asked and launched together (a parallel launcher runs them at once)
    pruner: str = "median"            # median | hyperband | none: stops unpromising trials at an evaluation
    pruner_args: Dict[str, Any] = field(default_factory=dict)  # e.g. n_startup_trials, n_warmup_steps
    # the share of this sweep's finished trials that may fail (an error, a diverged loss) before the
    # sweep stops with exit 1: 1.0 never stops (Hydra's Optuna sweeper defaults to 0.0, stopping at the
    # first failure; a learning-rate search expects some trials to diverge)
    max_failure_rate: float = 1.0
    params: Optional[Dict[str, str]] = None  # the search space in YAML: {lr: "tag(log, interval(1e-4, 1e-2))"}
    # a study continued on another process count or global batch is refused (its trials would be judged
    # against trials of another global batch); true: continue it all the same
    allow_geometry_change: bool = False
    trial: Optional[int] = None       # set by the sweeper for each job: the trial it runs (do not set)


store = ConfigStore.instance()
store.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="looplib")
for name, node in (("tpe", TPE), ("random", Random), ("grid", Grid), ("cmaes", CmaEs)):
    store.store(group="hydra/sweeper/sampler", name=name, node=node, provider="looplib")
