"""How a run ends: the one line the command line says for each ending (``ending``), the ending a
plain exception becomes (``as_ending``: a full disk, a lost rank), and the small helpers around
them. ``looplib.run.session.Session`` maps every way a run stops through these.
"""
from __future__ import annotations

import logging
import shlex
from pathlib import Path

from ..process import this
from ..process.launcher import launched_rank, lost_rank_line
from ..errors import (ConfigError, DiskFull, Interrupted, LostRank, NothingToDo, NumericError, PeerRefused, RunEnded,
                      SaveError, disk_full)
from .assembly import Record
from ..store.checkpoint_dir import step_dirs
from .signals import Signals

log = logging.getLogger("looplib")


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
    (posted on the launch's board, ``looplib.process.board``: the others then say they stopped
    because of it; identical lines from several ranks said once); any other ending by rank 0."""
    if isinstance(end, ConfigError):
        line = f"looplib: error: {end}"
        return line if this().board.post_refusal(line) else ""
    if isinstance(end, PeerRefused):
        line = refused_line(end.rank)
        return line if this().board.says(line) else ""
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
        return (f"looplib: error: {end.strerror}; free some space (or write elsewhere: another run directory, "
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
