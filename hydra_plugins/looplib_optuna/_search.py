"""The search behind ``hydra/sweeper=optuna`` (imported when a sweep starts; Hydra's plugin scan
skips modules whose name begins with ``_``, so Optuna is not imported by every run).

- The search space is read from the command line (and ``hydra.sweeper.params``) with Hydra's
  own override grammar: ``choice(a,b)`` (also ``+group=choice(...)``), ``range(start, stop[,
  step])`` (stop excluded, as in Hydra's grid sweeps), ``interval(low, high)`` and
  ``tag(log, interval(low, high))``. Every other override is passed to each trial unchanged.
- The study lives in ``<sweep dir>/study.db`` (SQLite) unless ``storage`` names another; it
  records the sweep it belongs to (search space, fixed overrides, metric, direction), so running
  the same command again continues it up to ``n_trials`` and a different sweep pointed at the
  same directory is refused. A trial left running by a sweep that died is marked failed (and
  not counted) when the sweep is run again.
- Each job gets ``hydra.sweeper.trial``/``storage``/``study_name`` so that it can report its
  evaluations to its trial (``looplib.cli.sweep.TrialReporter``) from any launcher's process.
- Under torchrun (several processes, one run each trial) rank 0 alone asks the study, touches its
  storage and tells it the results; it hands each batch of trials' overrides to the other ranks
  (over the run's process group, started here), which launch the same jobs: a trial trains one
  configuration on every rank.
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from hydra.core.utils import JobStatus
from omegaconf import DictConfig, OmegaConf

from looplib.store import rundir
from looplib.errors import EXIT_CONFIG, ConfigError

from ._comparable import check_geometry, check_signature, command, geometry
from ._ranks import Ranks, status_of

log = logging.getLogger("looplib")
STUDY_DB = "study.db"
DEFAULT_NAME = "looplib"
PRUNERS = ("median", "hyperband", "none")
COUNTED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


def refuse(key: str, problem: str, fix: str) -> None:
    """One line on stderr, exit 2 (also in ``LOOPLIB_EXIT_FILE``), before anything is written."""
    print(f"looplib: error: {ConfigError(key, problem, fix)}", file=sys.stderr, flush=True)
    rundir.write_exit_status(EXIT_CONFIG)
    sys.exit(EXIT_CONFIG)


def value_text(value: Any) -> str:
    """A trial's value as an override's value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def distribution(override: Override) -> optuna.distributions.BaseDistribution:
    """The Optuna distribution a sweep override describes (``ValueError``: not one Optuna can search)."""
    sweep = override.value()
    if isinstance(sweep, ChoiceSweep) or (isinstance(sweep, RangeSweep) and sweep.shuffle):
        return optuna.distributions.CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if isinstance(sweep, RangeSweep):
        points = list(override.sweep_iterator())
        if not points:
            raise ValueError("the range is empty")
        step = sweep.step if sweep.step is not None else 1
        if all(isinstance(p, int) for p in (sweep.start, sweep.stop, step)):
            return optuna.distributions.IntDistribution(min(points), max(points), step=abs(step))
        return optuna.distributions.FloatDistribution(min(points), max(points), step=abs(float(step)))
    if isinstance(sweep, IntervalSweep):
        unknown = set(sweep.tags) - {"log"}
        if unknown:
            raise ValueError(f"unknown tag {sorted(unknown)[0]!r} (tag(log, interval(low, high)) is the one known)")
        log_scale = "log" in sweep.tags
        if isinstance(sweep.start, int) and isinstance(sweep.end, int):
            return optuna.distributions.IntDistribution(sweep.start, sweep.end, log=log_scale)
        return optuna.distributions.FloatDistribution(float(sweep.start), float(sweep.end), log=log_scale)
    raise ValueError(f"{type(sweep).__name__} is not a search space (use choice, range, interval or tag(log, interval))")


def grid_points(name: str, dist: optuna.distributions.BaseDistribution) -> list:
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return list(dist.choices)
    if getattr(dist, "step", None) and not getattr(dist, "log", False):
        n = int(round((dist.high - dist.low) / dist.step)) + 1
        return [dist.low + i * dist.step for i in range(n)]
    refuse(name, "hydra/sweeper/sampler=grid needs a finite set of points, not an interval",
           f"use {name}=choice(...) or {name}=range(start,stop,step), or another sampler (tpe, random)")


class StudySearch:
    """One sweep: its checked settings, its study, and the loop that runs its trials."""

    def __init__(self, config: DictConfig, arguments: list[str], *, sampler, direction, storage, study_name,
                 n_trials, n_jobs, pruner, pruner_args, params, max_failure_rate=1.0, allow_geometry_change=False):
        if int(optuna.__version__.split(".")[0]) < 4:
            raise ImportError(f"Optuna {optuna.__version__} is installed")
        from looplib.run.settings import Sweep
        from looplib.cli.sweep import pruner as make_pruner
        self.config = config
        task = OmegaConf.to_container(config.get("sweep") or {}, resolve=True)
        try:
            job_sweep = Sweep(**task)
        except ConfigError as err:
            refuse(err.key, err.problem, err.fix)
        except TypeError as err:
            refuse("sweep", f"unknown key ({err})", "sweep has the keys metric and direction")
        self.metric = job_sweep.metric
        self.direction = direction or job_sweep.direction
        if self.direction not in ("minimize", "maximize"):
            refuse("hydra.sweeper.direction", f"{self.direction!r} is not a direction", "use minimize or maximize")
        for key, value in (("n_trials", n_trials), ("n_jobs", n_jobs)):
            if not isinstance(value, int) or value < 1:
                refuse(f"hydra.sweeper.{key}", f"{value!r} is not a positive whole number", f"use e.g. hydra.sweeper.{key}=1")
        if pruner not in PRUNERS:
            refuse("hydra.sweeper.pruner", f"{pruner!r} is not a pruner", "use median, hyperband or none")
        self.pruner_name, self.pruner_args = pruner, dict(pruner_args or {})
        try:
            self.pruner = make_pruner(pruner, self.pruner_args)
        except (TypeError, ValueError) as err:
            refuse("hydra.sweeper.pruner_args", f"{pruner} does not take {self.pruner_args} ({err})",
                   "see optuna.pruners' MedianPruner / HyperbandPruner arguments")
        self.n_trials, self.n_jobs = n_trials, n_jobs
        if isinstance(max_failure_rate, bool) or not isinstance(max_failure_rate, (int, float)) \
                or not 0 <= max_failure_rate <= 1:
            refuse("hydra.sweeper.max_failure_rate", f"{max_failure_rate!r} is not a share between 0 and 1",
                   "use e.g. hydra.sweeper.max_failure_rate=0.5 (1.0: never stop)")
        self.max_failure_rate = float(max_failure_rate)
        self.space, self.fixed = self.search_space(list(arguments) + [f"{k}={v}" for k, v in (params or {}).items()])
        self.given = self.conditional_ranges()  # key -> (the choice it follows, {option: distribution})
        if not any(name.lstrip("+~") == "eval_samples" for name in self.space):  # the metric can exist at all
            try:
                job_sweep.check_job(OmegaConf.select(config, "eval_samples", default=None,
                                                     throw_on_resolution_failure=False))
            except ConfigError as err:
                refuse(err.key, err.problem, err.fix)
        self.sampler_node = OmegaConf.to_container(sampler, resolve=True) if sampler is not None else {
            "_target_": "optuna.samplers.TPESampler"}
        self.sampler = self.make_sampler(0)
        self.sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        self.default_storage = storage is None
        self.storage = storage or f"sqlite:///{self.sweep_dir / STUDY_DB}"
        self.study_name = study_name or DEFAULT_NAME
        lines = list(arguments) + [f"{k}={v}" for k, v in (params or {}).items()]
        effective = {line.split("=", 1)[0].lstrip("+~"): line for line in lines}  # the last of a key wins
        self.signature = {"search": sorted(effective.values()), "metric": self.metric, "direction": self.direction}
        self.geometry = geometry(config, list(self.space))  # the process count and global batch of its trials
        self.allow_geometry_change = bool(allow_geometry_change)
        self.created = self.made_dir = False  # by this command: a study, its directory

    # ------------------------------------------------------------------ checks (nothing written yet)
    def search_space(self, lines: list[str]) -> tuple[dict, list[str]]:
        try:
            overrides = OverridesParser.create().parse_overrides(lines)
        except Exception as err:  # noqa: BLE001 - Hydra's parser errors: one line
            refuse("search space", str(err).splitlines()[0], "see docs/sweeps.md for choice, range, interval, tag(log, ...)")
        space, fixed = {}, []
        for override in overrides:
            if not override.is_sweep_override():
                fixed.append(override.input_line)
                continue
            name = override.get_key_element()
            try:
                space[name] = distribution(override)
            except ValueError as err:
                refuse(name, f"{override.input_line!r} is not a search space Optuna can use: {err}",
                       f"e.g. '{name}=tag(log, interval(1e-4, 1e-2))', '{name}=choice(a,b)' or '{name}=range(1,9)'")
        if not space:
            refuse("search space", "the command names no parameter to search",
                   "give one, e.g. 'lr=tag(log, interval(1e-4, 1e-2))' or '+precision=choice(fp32,bf16)'")
        return space, fixed

    def conditional_ranges(self) -> dict[str, tuple[str, dict]]:
        """``KEY@OPTION=RANGE``: KEY's range in the trials where a ``choice`` parameter took OPTION
        (``lr@muon=tag(log, interval(1e-3, 3e-2))`` beside ``+optim=choice(adamw,muon)``); a plain
        ``KEY=RANGE`` beside them is KEY's range for the other options. Each is its own Optuna
        parameter (``lr@muon``), suggested once the choice is known; the job gets ``KEY=value``."""
        by_key: dict[str, dict] = {}
        for name in [n for n in self.space if "@" in n]:
            key, option = name.split("@", 1)
            by_key.setdefault(key, {})[option] = self.space.pop(name)
        given = {}
        for key, ranges in by_key.items():
            options = set(ranges)
            owners = [n for n, d in self.space.items() if isinstance(d, optuna.distributions.CategoricalDistribution)
                      and options <= set(map(str, d.choices))]
            if len(owners) != 1:
                what = "no choice(...) parameter has" if not owners else f"{', '.join(owners)} all have"
                refuse(f"{key}@{sorted(options)[0]}", f"{what} the option(s) {', '.join(sorted(options))}",
                       f"add the choice it follows, e.g. '+optim=choice({','.join(sorted(options))})'")
            if key in self.space:  # the range of every other option
                ranges[""] = self.space.pop(key)
            given[key] = (owners[0], ranges)
        return given

    def suggest(self, trial: optuna.trial.Trial) -> dict:
        """The trial's values: the fixed space (asked), then each per-option range its choice selects."""
        values = dict(trial.params)
        for key, (owner, ranges) in self.given.items():
            option = str(values[owner])
            dist = ranges.get(option, ranges.get(""))
            if dist is not None:
                name = f"{key}@{option}" if option in ranges else key
                values[name] = trial._suggest(name, dist)
        return values

    def make_sampler(self, trials_before: int) -> optuna.samplers.BaseSampler:
        """The sampler; a seeded one continuing a study is seeded ``seed + trials_before``, so that
        it does not suggest again what the first run's startup trials tried."""
        node = dict(self.sampler_node)
        target = node.pop("_target_")
        if node.get("seed") is not None:
            node["seed"] += trials_before
        if target == "optuna.samplers.GridSampler":
            if self.given:
                refuse(f"{next(iter(self.given))}@...", "hydra/sweeper/sampler=grid searches one fixed grid, not a "
                       "range per option", "use the tpe or random sampler, or one range for every option")
            grid = {name: grid_points(name, dist) for name, dist in self.space.items()}
            self.n_trials = min(self.n_trials, math.prod(len(v) for v in grid.values()))
            return optuna.samplers.GridSampler(grid, **node)
        if target == "optuna.samplers.CmaEsSampler":
            try:
                import cmaes  # noqa: F401
            except ImportError:
                refuse("hydra.sweeper.sampler", "the CMA-ES sampler needs the cmaes package", "pip install cmaes")
        from hydra.utils import get_class
        try:
            return get_class(target)(**node)
        except Exception as err:  # noqa: BLE001
            refuse("hydra.sweeper.sampler", f"{target} refused its settings {node} ({err})",
                   "see Optuna's documentation of the sampler")

    def open_study(self) -> optuna.study.Study:
        """This sweep's study: created, or continued when the storage already holds it (the same
        sweep, on the same process count and global batch)."""
        existing = []
        if not self.default_storage or (self.sweep_dir / STUDY_DB).exists():
            existing = optuna.study.get_all_study_names(storage=self.storage)
        key = "hydra.sweep.dir" if self.default_storage else "hydra.sweeper.storage"
        if self.study_name in existing:
            study = optuna.load_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                      pruner=self.pruner)
            try:
                check_signature(study.user_attrs.get("looplib_sweep"), self.signature,
                                f"{self.storage} holds study {self.study_name!r}", key)
                check_geometry(study.user_attrs.get("looplib_geometry"), self.geometry, self.allow_geometry_change,
                               f"study {self.study_name!r} in {self.storage}", key)
            except ConfigError as err:
                refuse(err.key, err.problem, err.fix)
            study.sampler = self.make_sampler(len(study.get_trials(deepcopy=False)))
            return study
        if self.default_storage and (existing or rundir.results(self.sweep_dir)):
            held = ", ".join(existing) or ", ".join(rundir.results(self.sweep_dir)[:4])
            refuse(key, f"{self.sweep_dir} already holds another sweep ({held})",
                   f"give a new directory ({key}=...)")
        self.made_dir = not self.sweep_dir.exists()
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                    pruner=self.pruner, direction=self.direction)
        self.created = True
        study.set_user_attr("looplib_sweep", self.signature)
        study.set_user_attr("looplib_geometry", self.geometry)
        return study

    def forget_study(self) -> None:
        """A new study whose first jobs were refused (exit 2) leaves nothing behind: neither the study
        (whose failed trial would make the corrected command "another sweep") nor its directory."""
        if not self.created:
            return
        optuna.delete_study(study_name=self.study_name, storage=self.storage)
        if self.made_dir:
            rundir.forget(self.sweep_dir, fresh=True)

    # ------------------------------------------------------------------ the sweep
    def run(self, launcher) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.ranks = Ranks(self.config)
        if not self.ranks.main:
            return self.ranks.follow(launcher)  # rank 0 asks the study; this rank runs what it is handed
        try:
            self.search(launcher)
        except BaseException as err:  # a refusal, a stop, a crash: the other ranks stop with this one's status
            self.ranks.stop(status_of(err))
            raise

    def search(self, launcher) -> None:
        study = self.open_study()
        for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            log.warning("trial %d was left running by a sweep that stopped: marked failed, not counted", stale.number)
            study._storage.set_trial_user_attr(stale._trial_id, "interrupted", True)
            study.tell(stale.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        done = sum(t.state in COUNTED and not (t.user_attrs.get("interrupted") or t.user_attrs.get("refused"))
                   for t in study.get_trials(deepcopy=False))
        to_go = max(0, self.n_trials - done)
        log.info("study %r in %s: %d trial(s) done, %d to go (n_trials=%d); %s of %s, sampler %s, pruner %s",
                 self.study_name, self.storage, done, to_go, self.n_trials, self.direction, self.metric,
                 type(self.sampler).__name__, self.pruner_name)
        told: list = []
        while to_go > 0:
            batch = min(self.n_jobs, to_go)
            trials = [study.ask(self.space) for _ in range(batch)]
            jobs = []
            for trial in trials:
                values = self.suggest(trial)
                overrides = [f"{name.split('@')[0]}={value_text(value)}" for name, value in values.items()] + self.fixed
                trial.set_user_attr("overrides", overrides)
                trial.set_user_attr("command", command(overrides))  # with its launcher: its global batch
                trial.set_user_attr("geometry", self.geometry)  # where it ran (the study's, unless allowed to change)
                jobs.append(overrides + [f"hydra.sweeper.trial={trial.number}",
                                         f"hydra.sweeper.storage='{self.storage}'",
                                         f"hydra.sweeper.study_name='{self.study_name}'"])
            self.ranks.hand_out(jobs, trials[0].number)
            self.ranks.in_jobs = True  # the other ranks run these jobs: however they end, they end alike there
            try:
                returns = launcher.launch(jobs, initial_job_idx=trials[0].number)
            except BaseException as err:  # a job that stopped the sweep (exit 2, a signal): its trials failed
                refused = isinstance(err, SystemExit) and err.code == EXIT_CONFIG
                for trial in trials:
                    if refused:  # a refused setting: not a trial of the study (not counted when it goes on)
                        trial.set_user_attr("refused", True)
                    study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                if refused and not told:
                    self.forget_study()
                raise
            self.ranks.in_jobs = False
            for trial, ret in zip(trials, returns):
                self.tell(study, trial, ret)
            to_go -= batch
            told += trials
            self.stop_if_failing(study, told)
        self.ranks.end()  # the other ranks' sweep ends with this one's
        self.write_results(study)

    def stop_if_failing(self, study: optuna.study.Study, told: list) -> None:
        """Exit 1 (results written, study kept) once more than ``max_failure_rate`` of this sweep's
        finished trials failed."""
        states = study.get_trials(deepcopy=False)
        failed = [t.number for t in told if states[t.number].state == optuna.trial.TrialState.FAIL]
        if len(failed) / len(told) <= self.max_failure_rate:
            return
        self.ranks.stop(1)  # the other ranks stop with this one's status
        self.write_results(study)
        print(f"looplib: error: hydra.sweeper.max_failure_rate: {len(failed)} of the {len(told)} trials this sweep "
              f"ran failed ({len(failed) / len(told):.2g} > {self.max_failure_rate:g}), so it stopped; the study is "
              f"kept in {self.storage} (failed: {', '.join(str(self.sweep_dir / str(n)) for n in failed[:3])}"
              f"{', ...' if len(failed) > 3 else ''}): fix what they report, or raise "
              f"hydra.sweeper.max_failure_rate (1.0 never stops)", file=sys.stderr, flush=True)
        rundir.write_exit_status(1)  # the sweep's status, not its last job's
        sys.exit(1)

    def tell(self, study: optuna.study.Study, trial: optuna.trial.Trial, ret) -> None:
        value = ret.return_value if ret.status == JobStatus.COMPLETED else None
        if ret.status != JobStatus.COMPLETED:
            log.warning("trial %d failed: %r", trial.number, ret._return_value)
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = math.nan
        try:
            if math.isfinite(value):
                study.tell(trial.number, value, skip_if_finished=True)  # a pruned trial was told by its job
            else:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        except RuntimeError as err:  # the grid sampler, its grid done, calls study.stop(): told all the same
            if "Study.stop" not in str(err):
                raise
        state = study.get_trials(deepcopy=False)[trial.number].state
        log.info("trial %d %s: %s %s (%s)", trial.number, state.name.lower(), self.metric,
                 f"{value:.6g}" if math.isfinite(value) else "none",
                 " ".join(f"{k}={value_text(v)}" for k, v in trial.params.items()))

    def write_results(self, study: optuna.study.Study) -> None:
        """``optimization_results.yaml`` in the sweep directory, as Hydra's Optuna sweeper writes it."""
        try:
            best = study.best_trial
        except ValueError:
            log.warning("no trial of study %r completed: no best parameters", self.study_name)
            return
        results = {"name": "optuna", "best_params": best.params, "best_value": best.value,
                   "best_trial": best.number, "metric": self.metric, "direction": self.direction,
                   "study_name": self.study_name, "storage": self.storage,
                   "geometry": study.user_attrs.get("looplib_geometry", self.geometry),
                   "command": best.user_attrs.get("command") or command(best.user_attrs.get("overrides", []))}
        import yaml
        from looplib.atomic import write_atomic
        # one line per value, however long (the command is pasted whole)
        text = yaml.safe_dump(results, sort_keys=False, width=2**31 - 1, allow_unicode=True)
        write_atomic(self.sweep_dir / "optimization_results.yaml", text)
        log.info("best trial %d: %s %.6g with %s", best.number, self.metric, best.value, best.params)
