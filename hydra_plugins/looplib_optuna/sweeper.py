"""looplib's Optuna sweeper: ``python -m looplib.train -m hydra/sweeper=optuna ...``.

Hydra imports this module when it scans its plugins (every run), so it holds only the class
Hydra finds; the search itself (``_search.py``, which Hydra's scan skips) imports Optuna when
a sweep starts.
"""
from typing import Any, List, Optional

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from . import config  # noqa: F401 - registers hydra/sweeper=optuna and its samplers


class OptunaSweeper(Sweeper):
    """Asks the study for trials, launches them through Hydra's launcher, tells it each job's
    return value. The settings are ``OptunaSweeperConf``'s (``hydra.sweeper.*``)."""

    def __init__(self, sampler: Any = None, direction: Optional[str] = None, storage: Optional[str] = None,
                 study_name: Optional[str] = None, n_trials: int = 20, n_jobs: int = 1, pruner: str = "median",
                 pruner_args: Any = None, params: Any = None, max_failure_rate: float = 1.0,
                 allow_geometry_change: bool = False, trial: Optional[int] = None) -> None:
        self.settings = dict(sampler=sampler, direction=direction, storage=storage, study_name=study_name,
                             n_trials=n_trials, n_jobs=n_jobs, pruner=pruner, pruner_args=pruner_args,
                             params=params, max_failure_rate=max_failure_rate,
                             allow_geometry_change=allow_geometry_change)
        self.config: Optional[DictConfig] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        try:
            from ._search import StudySearch
            search = StudySearch(self.config, arguments, **self.settings)
        except ImportError as err:  # one line, exit 2, as for every setting looplib refuses
            import sys
            from looplib.errors import EXIT_CONFIG, ConfigError
            refused = ConfigError("hydra/sweeper=optuna", f"needs Optuna >= 4 ({err})", "pip install 'looplib[optuna]'")
            print(f"looplib: error: {refused}", file=sys.stderr, flush=True)
            sys.exit(EXIT_CONFIG)
        return search.run(self.launcher)
