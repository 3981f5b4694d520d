"""A run's whole life, as named steps in the order they happen: ``Session``. The command line
(``looplib.cli.main``) and ``train_model`` (``looplib.run.api``) each build one typed job (a
``JobSpec``) inside a session and hand it over; neither closes, cleans or reports anything itself,
and nothing here calls back into them.

    with Session(run_dir, signals) as session:   # every ending, however it comes, mapped on the way out
        spec = ...                                # the caller's: its checks may refuse here too
        session.run(spec)
            check      the checks that need no data and no model; every rank runs the same job
            claim      the run directory every rank shares, held by rank 0 for this run alone
            plan       the checkpoint a resume continues from, and its split on these processes
            build      the expensive parts (data, model: their recipes), then the job set up
            train      looplib.run.training.train
            close      the engine closed, once every rank got here

However the run ends, the precision puts back what its setup changed in the process (TF32's
flags) exactly once, and the ending is one exception, ``looplib.errors.RunEnded``, whose
``status`` is the command line's exit status and whose ``line`` is what it says (set here, once,
for every kind of ending: a refused setting, too many non-finite steps, a failed save, a lost
rank, a signal; the lines: ``looplib.run.endings``). A refusal is said by the rank that refuses,
whatever its rank, and the other ranks say they stopped because of it (``looplib.process.board``).
A run refused or stopped before it trained leaves nothing behind in a run directory that held
nothing before it.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..data.identity import Expected
from ..process import this
from ..errors import ConfigError, DiskFull, Interrupted, LostRank, NothingToDo, PeerRefused, RunEnded
from ..peft import FullModel
from .assembly import Job, JobSpec, Recipe, Trained, build, check as check_parts
from ..store.checkpoint_dir import seed_host_rngs
from .endings import as_ending, ending, fresh_file
from ..store.init_from import init_from
from ..store.lock import DirectoryHeld, NotALock, hold, holds, release
from ..store.resume import Resumed, expected_identity, plan
from ..store.rundir import forget, results
from .signals import Signals
from .training import train

log = logging.getLogger("looplib")


class Session:
    """One run, from its typed job to its ending. ``run_dir``: where it writes (None: nothing but
    ``metrics``); ``fresh``: it held nothing of a run before this one, so a run refused or stopped
    before training removes it whole; ``key``: the setting that names the directory, in a refusal;
    ``export``: the final weights are written."""

    def __init__(self, run_dir: Path | None, signals: Signals, *, fresh: bool = False, metrics: Path | None = None,
                 export: bool = True, key: str = "run_dir"):
        self.run_dir, self.signals, self.fresh, self.metrics = run_dir, signals, fresh, metrics
        self.export, self.key = export, key
        self.spec: JobSpec | None = None
        self.shared = False        # run_dir is rank 0's (another rank's directory on a rank other than 0)
        self.held: list[Path] = []  # the directory this process holds, released once the run has ended
        self.closed = False         # every rank closed the engine: nothing after that is a failure to map

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind, err, tb) -> bool:
        try:
            if err is not None:
                self.end(err)  # raises the run's ending (or returns: the error goes on as it is)
        finally:
            for path in self.held:
                release(path)
            this().board.job_done()
        return False

    def run(self, spec: JobSpec) -> Trained:
        """Check, claim, plan, build, train and close: the run's steps in order. Returns what was
        trained when the run finished (or when a reason of its own stopped it early: a sweep's
        pruner); raises (through the session's exit) ``RunEnded`` otherwise."""
        self.spec = spec
        try:
            self.check(spec)
            self.claim(spec)
            resumed = self.plan(spec)
            job = self.build(spec, resumed)
            trained = train(job, self.run_dir, self.signals, self.metrics, self.export, resumed)
        finally:
            if spec.parts.precision is not None:
                spec.parts.precision.close()  # TF32's process-wide flags: a sweep's next job starts clean
        return self.close(job, trained)

    def check(self, spec: JobSpec) -> None:
        """The checks between strategies that need no data and no model; then every rank agrees
        that it runs the same job (several processes: the same job on every rank, or none)."""
        check_parts(spec.parts, spec.settings)
        spec.parts.engine.ranks.agree(spec.record.config)

    def claim(self, spec: JobSpec) -> None:
        """The run directory every rank shares (rank 0's: one directory per run, not per rank),
        held for this run alone before anything is written."""
        engine = spec.parts.engine
        if self.run_dir is not None:
            common = engine.ranks.shared_run_dir(self.run_dir)
            if common != self.run_dir:
                forget(self.run_dir, fresh=True)  # this rank's scratch directory
                self.run_dir, self.fresh = common, self.fresh and not results(common)
            self.shared = True
            self.held += hold_for_ranks(engine, self.run_dir, self.key)
        elif self.metrics is not None and engine.is_main:
            self.metrics = fresh_file(self.metrics)

    def plan(self, spec: JobSpec) -> Resumed | None:
        """The checkpoint to continue from, and the split of its global batch on these processes:
        settled before the data, the model or the engine exist (a refusal costs nothing)."""
        return plan(spec.parts.engine, spec.settings, spec.record, self.run_dir, self.export)

    def build(self, spec: JobSpec, resumed: Resumed | None = None) -> Job:
        """The expensive parts (data changed under a resume: refused as it is read; the checkpoint's
        identity handed to them), then the job."""
        taken = str(resumed.path) if resumed is not None and resumed.path is not None else None
        expected = expected_identity(taken, self.run_dir)
        build_expensive(spec, expected)
        return build(spec.parts, spec.settings, spec.record, expected)

    def close(self, job: Job, trained: Trained) -> Trained:
        """The engine closed (a collective under DDP and DeepSpeed: only once every rank got
        here); a run stopped by a signal, saved at a step boundary, ends as ``Interrupted``: on the
        rank that got the signal and on every rank that stopped with it (exit 75 there too; a run
        that did not finish never exits 0, whichever rank its launcher or scheduler signalled)."""
        self.signals.finish()
        job.engine.close()
        self.closed = True
        if trained.state.preempted and self.signals.signum is not None:
            raise Interrupted(self.signals.signum, trained)
        if trained.state.preempted and self.signals.peer_signalled:  # stopped with a rank that was signalled
            raise Interrupted(None, trained)  # (not finished: 75 like that rank, never 0)
        return trained

    def end(self, err: BaseException) -> None:
        """``err`` as the run's ending: its line set, and what the run wrote removed where it
        was refused or stopped before training in a directory that held nothing before it."""
        signals, run_dir = self.signals, self.run_dir
        signals.finish()  # from here a signal changes nothing (torchrun's SIGTERM to the survivors of a lost rank)
        if self.closed:
            return  # raised by close (a signal's stop at a step boundary, saved): the ending as it is
        # another rank refused the job: whatever stopped this one (torchrun's SIGTERM, a lost peer) follows from it
        end = (None if isinstance(err, ConfigError) else this().board.refusal()) or \
            (err if isinstance(err, RunEnded) else as_ending(err, run_dir))
        if end is None:
            return
        if not isinstance(end, LostRank):
            end.line = ending(end, signals, self.spec.record if self.spec is not None else None, run_dir)
        ours = run_dir is not None and (not self.shared or holds(run_dir))  # rank 0's directory is rank 0's to clean
        if not signals.training and isinstance(end, (ConfigError, Interrupted, DiskFull, PeerRefused, NothingToDo)) \
                and ours and not isinstance(end, DirectoryHeld):  # another run's directory: not a byte of it is ours
            forget(run_dir, self.fresh)  # found before training: nothing of this run stays behind
        if end is not err:
            raise end from err


def build_expensive(spec: JobSpec, expected: Expected | None = None) -> None:
    """The parts given as recipes, built now that every cheap check has passed: the seed first
    (their initialisation is seeded; Python's and NumPy's too), the data (``expected``: the
    identity of the checkpoint a resume takes, which the data compare themselves with as they are
    built), then the model (inside the adapter's ``loading``: QLoRA loads a transformers model in
    4 bits); then a finished run's weights (``init_from``). Parts given as objects were built by
    their caller."""
    parts = spec.parts
    if isinstance(parts.data, Recipe) or isinstance(parts.model, Recipe):
        torch.manual_seed(spec.settings.seed)
        seed_host_rngs(spec.settings.seed)
    if isinstance(parts.data, Recipe):
        parts.data = parts.data.build(expected=expected) if expected is not None else parts.data.build()
    if isinstance(parts.model, Recipe):
        with (parts.peft or FullModel()).loading():
            parts.model = parts.model.build()
    if spec.init_from:
        init_from(parts.model, spec.init_from)


def assemble(spec: JobSpec) -> Job:
    """Check, build the expensive parts, build the job: a run ready to train (what a session
    trains; a tool that probes a job without training it calls this alone)."""
    check_parts(spec.parts, spec.settings)
    spec.parts.engine.ranks.agree(spec.record.config)
    build_expensive(spec)
    return build(spec.parts, spec.settings, spec.record)


def hold_for_ranks(engine, run_dir: Path, key: str) -> list[Path]:
    """Rank 0 holds ``run_dir`` for every rank (``looplib.store.lock``); every rank learns the outcome
    from it, so a directory held by another run is refused alike everywhere. Returns what this
    process holds ([run_dir], or [] where another rank holds it)."""
    refusal = None
    if engine.is_main:
        try:
            hold(run_dir, key)
        except DirectoryHeld as err:
            refusal = (err.key, err.problem, err.fix, isinstance(err, NotALock))
    refusal = engine.ranks.from_main(refusal)
    if refusal is not None:
        raise (NotALock if refusal[3] else DirectoryHeld)(*refusal[:3])
    return [run_dir] if engine.is_main else []
