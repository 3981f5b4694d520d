"""Resuming a run: which checkpoint to continue from, which config changes it accepts, and the
restore itself.

``resume(checkpoints, state, where, run_dir)`` finds the checkpoint (``resume=auto``: the newest
valid one of this run directory; ``resume=PATH``: that checkpoint or run directory), loads it
into the parts bound to ``checkpoints`` (``looplib.run.saving.Checkpoints``) and trims metrics
rows written after it. A changed setting is accepted only if it cannot alter what the run
computes (``SAFE_TO_CHANGE``, or what the engine accepts); any other change is refused with one
line naming it.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..atomic import write_atomic
from ..data import identity
from ..errors import ConfigError, NothingToDo
from ..train_state import TrainState
from .checkpoint_dir import InvalidCheckpoint, find_checkpoint, inspect_checkpoint, set_rng_state, step_dirs, unwrap
from .saving import Checkpoints

log = logging.getLogger("looplib")

# Keys whose change does not alter the training trajectory: accepted on resume, and reported.
SAFE_TO_CHANGE = ("max_steps", "log_every", "eval_every", "eval_samples", "eval_batches", "sample_tokens", "progress",
                  "resume", "checkpoint", "max_bad_steps", "loader.num_workers", "loader.pin_memory",
                  "loader.persistent_workers", "loader.prefetch_factor", "hydra")


def config_changes(saved: dict, now: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every leaf that differs."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, name + ".")
        elif a != b:
            out.append((name, a, b))
    return out


def check_resume_config(saved: dict, now: dict) -> list[str]:
    """Refuse a change that breaks the run; return the safe changes, to be reported."""
    safe = []
    for key, a, b in config_changes(saved, now):
        if any(key == s or key.startswith(s + ".") for s in SAFE_TO_CHANGE):
            safe.append(f"{key}: {a!r} -> {b!r}")
            continue
        raise ConfigError("resume", f"the config changed {key} from {a!r} to {b!r} since the checkpoint, "
                          "which would change what the resumed run computes",
                          f"set {key}={a!r} again, or start a new run in a new directory")
    return safe


def accepted_changes(checkpoints: Checkpoints, saved: dict, path: Path) -> list[str]:
    """Refuse a config change that alters the run (``ConfigError``); return the accepted ones.
    An engine may accept a change the saved config alone cannot judge (FSDP: another number
    of processes splitting the same global batch differently)."""
    if not checkpoints.config:  # no config known: nothing to compare
        return []
    now = json.loads(json.dumps(checkpoints.config))  # a copy the engine may edit
    accepted = checkpoints.engine.resume_config(saved, now, path) + check_resume_config(saved, now)
    identity.refuse(identity.read(path), checkpoints.identity, path)  # the same data and tokenizer, or none
    return accepted


def expected_identity(where: str | None, run_dir: Path | None) -> identity.Expected | None:
    """The data fingerprint of the checkpoint a resume will take (the newest complete one at
    ``where``; read before the data are built, so that a run on changed data is refused before it
    tokenises them). Cheap: no checksum is verified here; ``find`` checks the one it loads."""
    if not where or run_dir is None:
        return None
    at = Path(run_dir) if where == "auto" else Path(where)
    if (at / "manifest.json").exists() or at.name.startswith("step-"):
        candidates = [at]
    else:
        candidates = step_dirs(at / "checkpoints" if (at / "checkpoints").is_dir() else at)
    for path in candidates:
        if (path / "manifest.json").is_file():
            found = identity.read(path)
            return identity.Expected(found, path) if found else None
    return None


def find(checkpoints: Checkpoints, where: Path, found: dict | None = None) -> Path | None:
    """The newest valid checkpoint at ``where`` for this model and engine (see ``find_checkpoint``)."""
    return find_checkpoint(where, checkpoints.parts.get("model"), checkpoints.own_format, found,
                           lambda saved, path: accepted_changes(checkpoints, saved, path))


def load(checkpoints: Checkpoints, path: Path, state: TrainState, checked: dict | None = None) -> list[str]:
    """Restore everything from ``path`` into the parts bound to ``checkpoints`` and ``state``.
    Returns the config changes accepted as safe. ``checked``: what ``inspect_checkpoint`` read
    from it (validated again here otherwise); nothing is loaded before it has passed."""
    from safetensors.torch import load_model

    try:
        checked = checked or inspect_checkpoint(path, checkpoints.parts.get("model"), checkpoints.own_format,
                                                lambda saved, where: accepted_changes(checkpoints, saved, where))
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{path} is not a valid checkpoint: {err}",
                          "resume from another checkpoint, or use resume=auto to take the newest valid one") from None
    p = checkpoints.parts
    if checkpoints.own_format:  # the engine's own format (FSDP, DeepSpeed)
        blob = checkpoints.engine.load_checkpoint(path.parent, tag=path.name)
    else:
        blob = checked["state"]
        load_model(unwrap(p["model"]), str(path / "model.safetensors"))
        p["optimizer"].load_state_dict(blob["optimizer"])
        p["precision"].load_state_dict(blob["precision"])
    p["scheduler"].load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"])
    pos = blob["position"]
    state.step, state.epoch, state.bad_streak = pos["step"], pos["epoch"], pos["bad_streak"]
    state.longest_streak = state.bad_streak
    state.batches_seen, state.extra = pos["batches_seen"], blob.get("extra", {})
    p["epochs"].epoch, p["epochs"].batches_seen = pos["epoch"], pos["batches_seen"]
    checkpoints.last_saved_step = state.step
    return checked["accepted"]


def resume(checkpoints: Checkpoints, state: TrainState, where: str, run_dir: Path, max_steps: int) -> None:
    """``resume=auto``: the newest valid checkpoint of this run directory (none: start afresh);
    ``resume=PATH``: a checkpoint, or a run directory holding some. Invalid checkpoints (see
    ``checkpoint_dir.inspect_checkpoint``) are skipped with a warning, or refused when named directly.
    A checkpoint at ``max_steps`` already is ``NothingToDo``, one past it a ``ConfigError``: both
    before anything is loaded or written."""
    found: dict = {}
    try:
        path = find(checkpoints, run_dir if where == "auto" else Path(where), found)
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{where} is not a valid checkpoint: {err}",
                          "give a complete checkpoint (.../checkpoints/step-N) or a run directory, or use "
                          "resume=auto") from None
    if path is None:
        if where != "auto":
            raise ConfigError("resume", f"no valid checkpoint at {where}",
                              "give a checkpoint directory (.../checkpoints/step-N) or a run directory")
        log.warning("resume=auto: no valid checkpoint in %s yet, starting at step 0 (to continue an earlier "
                    "run, pass its directory: hydra.run.dir=...)", run_dir)
    else:
        at = found[path]["step"]
        if at > max_steps:
            raise ConfigError("max_steps", f"max_steps={max_steps} is below the step of the checkpoint it resumes "
                              f"({at}, {path}): a run cannot go back", f"give max_steps above {at} to train further, "
                              f"or start a new run in a new directory to train {max_steps} steps")
        if at == max_steps:
            raise NothingToDo(f"the run in {run_dir} is at step {at} already (max_steps={max_steps}), its files "
                              f"untouched; give max_steps above {at} to train further")
        accepted = load(checkpoints, path, state, found.get(path))
        log.info("resumed from %s at step %d (epoch %d, batch %d)%s", path, state.step, state.epoch,
                 state.batches_seen, "; changed: " + ", ".join(accepted) if accepted else "")
    metrics = run_dir / "metrics.jsonl"  # (a run killed before its first checkpoint restarts at 0)
    if checkpoints.is_main and metrics.exists():  # rows past the checkpoint came from the run that died
        rows = []
        for line in metrics.read_text().splitlines():
            try:
                if line.strip() and json.loads(line).get("step", 0) <= state.step:
                    rows.append(line)
            except (ValueError, AttributeError):  # a row cut short by a kill: dropped
                pass
        write_atomic(metrics, "".join(row + "\n" for row in rows))
