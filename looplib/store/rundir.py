"""The run directory: never write into another run's results, never leave a half-written one.

The rules (``train_model`` checks its ``run_dir`` here; the command line applies them in
``looplib.cli.guard`` before anything is written):

- a directory that already holds a run's results (anything but hidden entries and ``*.log``:
  checkpoints, metrics.jsonl, model.safetensors, ...) is refused unless the job continues that
  run (``resume=auto``, or ``resume=PATH`` inside it). Hidden entries are bookkeeping: the lock
  (``looplib.store.lock``) and the record a front end keeps of the command that started the run
  (the command line's, see ``looplib.cli.guard``); a caller names any other such file (``besides``);
- a directory that cannot be made or written (a file in its place, a read-only parent) is
  refused with one line instead of a traceback.

Every rank checks rank 0's directory, so under torchrun every rank refuses alike (exit 2).
``forget`` removes what a run wrote into a directory that was empty before it, when the run
ends before training (a refused setting, a signal): nothing half-written stays behind.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..atomic import write_atomic
from ..process.launcher import launched_rank
from ..errors import ConfigError
from .checkpoint_dir import step_dirs
from .lock import DirectoryHeld, held_by

def results(path: Path, besides: tuple[str, ...] = ()) -> list[str]:
    """What ``path`` holds besides bookkeeping (hidden entries, logs, the names ``besides``):
    sorted names; [] for a new directory. A subdirectory counts only if it holds something
    itself (a sweep's job directories hold only bookkeeping until their jobs run; under torchrun
    rank 0 may have made them before another rank looks)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if not p.name.startswith(".") and p.name not in besides
                  and not p.name.endswith(".log") and not (p.is_dir() and not p.is_symlink() and not results(p)))


def unwritable(path: Path) -> str | None:
    """Why a directory cannot be made or written at ``path``, or None."""
    probe = path
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def check(path: Path, resume: str | None, key: str, besides: tuple[str, ...] = ()) -> None:
    """Refuse a run directory that cannot be written or holds another run (``ConfigError``);
    ``besides``: names that are no results there (``results``)."""
    why = unwritable(path)
    if why:
        raise ConfigError(key, f"cannot write the run directory {path}: {why}",
                          f"give a writable directory ({key}=...)")
    held = results(path, besides)
    if not held:
        return
    inside = resume and resume != "auto" and Path(resume).resolve().is_relative_to(path.resolve())
    if resume == "auto" or inside:
        return  # this directory's own run, continued
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    who = held_by(path)
    if who is not None:  # resume=auto would be refused too: the run is still going
        raise DirectoryHeld(key, f"{path} holds a run that is still going ({who}; its files: {shown}): two runs in "
                            "one directory would write over each other's checkpoints and metrics",
                            f"wait for that run to end (resume=auto then continues it), or give a new directory "
                            f"({key}=...)")
    if resume:
        raise ConfigError(key, f"{path} already holds files ({shown}); resuming {resume} into it "
                          "would mix two runs", f"give a new directory ({key}=...)")
    raise ConfigError(key, f"{path} already holds files ({shown}) that this run would overwrite or mix with its own",
                      f"continue it with resume=auto, or give a new directory ({key}=...)")


def write_exit_status(status: int, every_rank: bool = False) -> None:
    """``LOOPLIB_EXIT_FILE``: rank 0 writes its exit status there as its last act. Launchers
    (torchrun) report 1 when a rank exits non-zero, so a job script reads looplib's status here.
    ``every_rank``: a refusal, written by the rank that refuses whatever its rank (the launcher may
    stop rank 0 before it writes; rank 0 then writes the same status, learnt from the board)."""
    path = os.environ.get("LOOPLIB_EXIT_FILE")
    if path and (every_rank or launched_rank() == 0):
        write_atomic(path, f"{status}\n")


EXPORTS = ("model.safetensors", "adapter", "hf")  # what a finished run exports (one of them), each written whole


def exported(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` wrote its weights (each export is written beside and renamed)."""
    return any((Path(run_dir) / name).exists() for name in EXPORTS)


def artefacts(run_dir: Path) -> dict[str, str]:
    """What the run left for people to use, by name, where it exists."""
    out = {}
    for name, rel in (("model", "model.safetensors"), ("adapter", "adapter"), ("hf", "hf"),
                      ("config", "config.yaml"), ("metrics", "metrics.jsonl")):
        if (run_dir / rel).exists():
            out[name] = str(run_dir / rel)
    newest = step_dirs(run_dir / "checkpoints")  # newest first; the run just wrote it (no re-hash)
    if newest:
        out["checkpoint"] = str(newest[0])
    return out


def latest_resumable(root: Path, max_steps: int | None = None) -> tuple[Path, int] | None:
    """The most recent run directory under ``root`` whose newest valid checkpoint can still be
    continued (its step below ``max_steps``, or, not given, below the run's own; or at it, where the
    run never wrote its weights), and its step."""
    from .checkpoint_dir import is_valid, read_config
    runs = {p.parent for depth in ("*/checkpoints", "*/*/checkpoints") for p in root.glob(depth) if p.is_dir()}
    for run in sorted(runs, key=lambda p: (p / "checkpoints").stat().st_mtime, reverse=True):
        for step in step_dirs(run / "checkpoints"):
            if is_valid(step) is None:
                digits = "".join(c for c in step.name if c.isdigit())
                try:
                    goal = max_steps or int(read_config(step / "config.yaml").get("max_steps", 0))
                except (ValueError, TypeError):
                    goal = 0
                if int(digits or 0) < goal or (int(digits or 0) == goal and not exported(run)):
                    return run, int(digits or 0)  # (at its end without its weights: resume=auto writes them)
                break  # its newest checkpoint is its end: a finished run, nothing to continue
    return None


def forget(path: Path, fresh: bool) -> None:
    """After a run that ended before training: remove what it wrote. A directory that held
    nothing before the run (``fresh``) is removed whole; otherwise only the bookkeeping of this
    attempt would be new, and the directory is left as it is."""
    if not fresh or not path.is_dir():
        return
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        return
    here = Path.cwd().resolve()
    for parent in path.resolve().parents:  # outputs/<date>/ made for it, if now empty
        if parent == here or here not in parent.parents:
            break
        try:
            parent.rmdir()
        except OSError:
            break
