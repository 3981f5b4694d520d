"""A run's whole life, in one function: ``execute``. The command line (``looplib.cli.main``) and
``train_model`` (``looplib.run.api``) both call it; neither closes, cleans or reports anything itself.

    make the parts (cheap)  ->  check  ->  every rank agrees  ->  the run directory every rank shares,
        held by rank 0 for this run alone (looplib.run.lock)  ->  the checkpoint a resume continues
        from  ->  the expensive parts (data, model)  ->  build  ->  train  ->  close the engine

However the run ends, the precision puts back what its setup changed in the process (TF32's
flags) exactly once, and the ending is one exception, ``looplib.errors.RunEnded``, whose
``status`` is the command line's exit status and whose ``line`` is what it says (set here, once,
for every kind of ending: a refused setting, too many non-finite steps, a failed save, a lost
rank, a signal). A refusal is said by the rank that refuses, whatever its rank, and the other
ranks say they stopped because of it (``looplib.engines.board``). A run refused or stopped before
it trained leaves nothing behind in a run directory that held nothing before it.
"""
from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Callable

from ..engines import board
from ..engines.launch import launched_rank, lost_rank_line
from ..data.identity import expecting
from ..errors import (ConfigError, DiskFull, Interrupted, LostRank, NothingToDo, NumericError, PeerRefused, RunEnded,
                      SaveError, disk_full)
from .assembly import Job, Parts, Record, Trained, build, check
from .checkpoint_dir import step_dirs
from .lock import DirectoryHeld, NotALock, hold, holds, release
from .resume import expected_identity, plan
from .rundir import forget, results
from .settings import Settings
from .signals import Signals
from .training import train

log = logging.getLogger("looplib")


def execute(make: Callable[[], tuple[Parts, Settings, Record]], run_dir: Path | None, signals: Signals, *,
            fresh: bool = False, metrics: Path | None = None, export: bool = True, key: str = "run_dir") -> Trained:
    """Run the job that ``make`` describes (it raises ``ConfigError`` on a bad setting) in ``run_dir``
    (None: nothing written but ``metrics``), held for this run alone (``looplib.run.lock``; ``key``:
    the setting that names it, in the refusal). ``fresh``: ``run_dir`` held nothing of a run before
    this one, so a run refused or stopped before training removes it whole. Returns what was
    trained when the run finished (or when a reason of its own stopped it early: a sweep's
    pruner); raises ``RunEnded`` otherwise."""
    held: list[Path] = []  # the directory this process holds, released once the run has ended (and forgotten it)
    try:
        return run(make, run_dir, signals, fresh, metrics, export, key, held)
    finally:
        for path in held:
            release(path)
        board.job_done()


def run(make, run_dir: Path | None, signals: Signals, fresh: bool, metrics: Path | None, export: bool, key: str,
        held: list[Path]) -> Trained:
    """``execute``'s run (``held``: receives the run directory once held)."""
    parts = record = job = None
    shared = False  # run_dir is rank 0's (another rank's directory on a rank other than 0)
    try:
        try:
            parts, settings, record = make()
            check(parts, settings)
            parts.engine.agree(record.config)  # several processes: the same job on every rank, or none
            if run_dir is not None:
                common = parts.engine.shared_run_dir(run_dir)  # rank 0's: one directory per run, not per rank
                if common != run_dir:
                    forget(run_dir, fresh=True)  # this rank's scratch directory
                    run_dir, fresh = common, fresh and not results(common)
                shared = True
                held += hold_for_ranks(parts.engine, run_dir, key)  # one run at a time, before anything is written
            elif metrics is not None and parts.engine.is_main:
                metrics = fresh_file(metrics)
            # the checkpoint to continue from, and the split of its global batch on these processes:
            # settled before the data, the model or the engine exist (a refusal costs nothing)
            resumed = plan(parts.engine, settings, record, run_dir, export)
            taken = str(resumed.path) if resumed is not None and resumed.path is not None else None
            with expecting(expected_identity(taken, run_dir)):  # data changed under a resume: refused early
                parts.build_later()
                job = build(parts, settings, record)
            trained = train(job, run_dir, signals, metrics, export, resumed)
        finally:
            if parts is not None and parts.precision is not None:
                parts.precision.close()  # TF32's process-wide flags: a sweep's next job starts clean
    except BaseException as err:
        signals.finish()  # from here a signal changes nothing (torchrun's SIGTERM to the survivors of a lost rank)
        # another rank refused the job: whatever stopped this one (torchrun's SIGTERM, a lost peer) follows from it
        end = (None if isinstance(err, ConfigError) else board.refusal()) or \
            (err if isinstance(err, RunEnded) else as_ending(err, run_dir))
        if end is None:
            raise
        if not isinstance(end, LostRank):
            end.line = ending(end, signals, record, run_dir)
        ours = run_dir is not None and (not shared or holds(run_dir))  # rank 0's directory is rank 0's to clean
        if not signals.training and isinstance(end, (ConfigError, Interrupted, DiskFull, PeerRefused, NothingToDo)) \
                and ours \
                and not isinstance(end, DirectoryHeld):  # another run's directory: not a byte of it is ours
            forget(run_dir, fresh)  # found before training: nothing of this run stays behind
        if end is err:
            raise
        raise end from err
    signals.finish()
    if trained.state.preempted and signals.signum is not None:  # saved at a step boundary, said in the log
        job.engine.close()  # every rank got here
        raise Interrupted(signals.signum, trained)
    job.engine.close()  # a collective (DDP, DeepSpeed): only when every rank got here
    return trained


def hold_for_ranks(engine, run_dir: Path, key: str) -> list[Path]:
    """Rank 0 holds ``run_dir`` for every rank (``looplib.run.lock``); every rank learns the outcome
    from it, so a directory held by another run is refused alike everywhere. Returns what this
    process holds ([run_dir], or [] where another rank holds it)."""
    refusal = None
    if engine.is_main:
        try:
            hold(run_dir, key)
        except DirectoryHeld as err:
            refusal = (err.key, err.problem, err.fix, isinstance(err, NotALock))
    refusal = engine.from_main(refusal)
    if refusal is not None:
        raise (NotALock if refusal[3] else DirectoryHeld)(*refusal[:3])
    return [run_dir] if engine.is_main else []


def assemble(parts: Parts, settings: Settings, record: Record) -> Job:
    """Check, build the expensive parts, build the job: a run ready to train (what ``execute``
    trains; a tool that probes a job without training it calls this alone)."""
    check(parts, settings)
    parts.engine.agree(record.config)  # several processes: the same job on every rank, or none
    parts.build_later()
    return build(parts, settings, record)


def as_ending(err: BaseException, run_dir: Path | None) -> RunEnded | None:
    """A full disk (``DiskFull``), or a collective that failed because another rank is gone
    (``LostRank``, its line said by the first survivor of each host); None for anything else."""
    if not isinstance(err, Exception):
        return None
    full = disk_full(err, str(run_dir) if run_dir is not None else None)
    if full is not None:
        return full
    line = lost_rank_line(err)
    if line is None:
        return None
    lost = LostRank(line.removeprefix("looplib: stopped: "))
    lost.line = line
    return lost


def ending(end: RunEnded, signals: Signals, record: Record | None, run_dir: Path | None) -> str:
    """The one line the command line says for ``end``. A refusal is said by the rank that refuses
    (posted on the launch's board, ``looplib.engines.board``: the others then say they stopped
    because of it; identical lines from several ranks said once); any other ending by rank 0."""
    if isinstance(end, ConfigError):
        line = f"looplib: error: {end}"
        return line if board.post_refusal(line) else ""
    if isinstance(end, PeerRefused):
        line = refused_line(end.rank)
        return line if board.says(line) else ""
    if launched_rank() != 0:
        return ""
    if isinstance(end, NothingToDo):
        return f"looplib: nothing to do: {end}"
    if isinstance(end, NumericError):
        return f"looplib: stopped: {end}"
    if isinstance(end, SaveError):
        full = disk_full(end.cause, str(end.path))
        what = f"could not write the checkpoint {end.path}: {full.strerror}" if full is not None else str(end)
        if not complete_checkpoint(Path(end.path).parent, Path(end.path)):
            return (f"looplib: error: {what}; no checkpoint of this run was complete before it, so nothing is saved "
                    "(run the command again with resume=auto: it starts again at step 0)")
        return f"looplib: error: {what}; the last complete checkpoint stays (resume=auto continues from it)"
    if isinstance(end, DiskFull):
        saved = run_dir is not None and complete_checkpoint(run_dir / "checkpoints")
        return (f"looplib: error: {end.strerror}; free some space (or write elsewhere: hydra.run.dir=..., "
                "LOOPLIB_CACHE=...) and run the command again " +
                ("(resume=auto continues from the last complete checkpoint)" if saved else
                 "(no checkpoint of this run is complete: it starts again at step 0)"))
    if isinstance(end, Interrupted) and signals.training:  # a second Ctrl-C while training
        hint = (record.resume_hint if record is not None else "resume=auto").format(
            run_dir=shlex.quote(str(run_dir)))
        return f"looplib: stopped at once ({end}); the last complete checkpoint stays. Continue with: {hint}"
    if isinstance(end, Interrupted):
        return f"looplib: stopped ({end}) before training started; nothing was saved"
    return f"looplib: stopped: {end}"


def complete_checkpoint(root: Path, but: Path | None = None) -> bool:
    """Whether ``root`` holds a complete checkpoint (its manifest, written last, exists) other than ``but``."""
    return any((d / "manifest.json").is_file() and d != but for d in step_dirs(root))


def refused_line(rank: int) -> str:
    """What the ranks that did not refuse say (the same on each: said once)."""
    return f"looplib: stopped: rank {rank} refused the job, so the other ranks stopped too (nothing was trained)"


def fresh_file(path: Path) -> Path:
    """``metrics=PATH`` without a run directory holds this run's rows only: never appended to another run's."""
    if path.exists() and path.stat().st_size:
        log.warning("metrics=%s held an earlier run's rows: starting it afresh for this run", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path
