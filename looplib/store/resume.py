"""Resuming a run: which checkpoint to continue from, which config changes it accepts, and the
restore itself.

``plan(engine, settings, record, run_dir)`` runs before the data, the model or the engine exist:
it finds the checkpoint (``resume=auto``: the newest valid one of this run directory;
``resume=PATH``: that checkpoint or run directory), refuses what cannot resume, and chooses the
split of the checkpoint's global batch on this run's processes (``looplib.store.elastic``).
``resume(checkpoints, state, where, run_dir, max_steps, resumed)`` then loads it into the parts
bound to ``checkpoints`` (``looplib.store.saving.Checkpoints``), in whichever form it holds model
and optimizer state, and trims metrics rows written after it. A changed setting is accepted
only if it cannot alter what the run computes (``SAFE_TO_CHANGE``; another split of the same
global batch; a switch between the local engine, DDP and FSDP); any other change is refused
with one line naming it.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from ..atomic import write_atomic
from ..data import identity
from ..errors import ConfigError, NothingToDo
from ..schema import same_target
from ..train_state import TrainState
from . import elastic
from .checkpoint_dir import (InvalidCheckpoint, check_weights, find_checkpoint, inspect_checkpoint, set_rng_state,
                             step_dirs, unwrap)
from .formats import of as format_of
from .rundir import EXPORTS, exported
from .saving import Checkpoints
from ..run.settings import NOT_ARGUMENTS

log = logging.getLogger("looplib")

# Keys whose change does not alter the training trajectory: accepted on resume, and reported.
SAFE_TO_CHANGE = ("max_steps", "log_every", "eval_every", "eval_samples", "eval_batches", "sample_tokens", "progress",
                  "resume", "checkpoint", "max_bad_steps", "loader.num_workers", "loader.pin_memory",
                  "loader.persistent_workers", "loader.prefetch_factor")


def config_changes(saved: dict, now: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every leaf that differs."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, name + ".")
        elif key == "_target_" and same_target(a, b):  # one class, two spellings (a package's export)
            continue
        elif a != b:
            out.append((name, a, b))
    return out


def check_resume_config(saved: dict, now: dict) -> list[str]:
    """Refuse a change that breaks the run; return the safe changes, to be reported."""
    # a Python run's config.yaml once recorded top-level lr and weight_decay, which train_model never used
    saved = {k: v for k, v in saved.items() if k in now or k not in NOT_ARGUMENTS}
    safe = []
    for key, a, b in config_changes(saved, now):
        if any(key == s or key.startswith(s + ".") for s in SAFE_TO_CHANGE):
            safe.append(f"{key}: {a!r} -> {b!r}")
            continue
        raise ConfigError("resume", f"the config changed {key} from {a!r} to {b!r} since the checkpoint, "
                          "which would change what the resumed run computes",
                          f"set {key}={a!r} again, or start a new run in a new directory")
    return safe


@dataclass
class Resumed:
    """The checkpoint a resume continues from (None: ``resume=auto`` found none), found and
    checked before anything was built, and the geometry it was written with."""
    path: Path | None
    checked: dict | None = None
    saved: elastic.Geometry | None = None
    finishing: bool = False  # at max_steps already, its exports never written: written now, nothing trained


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


def check_reference(now: dict | None, e: identity.Expected | None) -> None:
    """A DPO run resumed with another reference (its starting weights changed: a model directory
    edited, another ``model.path``) would continue against other log-probabilities: refused
    before anything is computed, naming both digests (``looplib.reference``). ``e``: the identity of
    the checkpoint the resume continues from (None: no resume)."""
    saved = e.get("reference") if e is not None else None
    if not isinstance(saved, dict) or not isinstance(now, dict) or saved.get("weights") == now.get("weights"):
        return
    raise ConfigError("resume", f"the DPO reference's weights differ from those the checkpoint {e.checkpoint} was "
                      f"trained against (digest {str(saved.get('weights'))[:12]} then, {str(now.get('weights'))[:12]} "
                      "now), so the resumed run would compare with another model",
                      "start from the same weights (model.path, model settings) to continue this run, or start a "
                      "new run in a new directory (without resume)")


def locate(where: str, run_dir: Path | None) -> tuple[Path | None, dict | None]:
    """The checkpoint ``resume=where`` names (``auto``: the newest valid one of ``run_dir``), every
    file checked against its manifest; ``(None, None)`` when ``auto`` finds none."""
    found: dict = {}
    try:
        path = find_checkpoint(run_dir if where == "auto" else Path(where), None, None, found)
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{where} is not a valid checkpoint: {err}",
                          "give a complete checkpoint (.../checkpoints/step-N) or a run directory, or use "
                          "resume=auto") from None
    if path is None and where != "auto":
        raise ConfigError("resume", f"no valid checkpoint at {where}",
                          "give a checkpoint directory (.../checkpoints/step-N) or a run directory")
    return path, found.get(path)


def plan(engine, settings, record, run_dir: Path | None, export: bool = False) -> Resumed | None:
    """Before the data, the model or the engine exist: find the checkpoint to resume, refuse an
    engine it cannot load into, choose the split of its global batch on this run's processes
    (``settings`` and the record's config then hold it), refuse an epoch end the processes cannot
    reproduce, and tell the engine (DeepSpeed: a universal checkpoint). None when the run does not
    resume. (What changed is said when the checkpoint loads: ``resume``.) ``export``: the run writes
    its weights at the end (a finished run whose weights are missing then writes them)."""
    if settings.resume is None:
        return None
    path, checked = locate(settings.resume, run_dir)
    if path is None:
        return Resumed(None)
    saved = elastic.saved_geometry(path, checked["meta"], checked["config"], engine.world_size)
    elastic.check_engine(saved, engine, checked["config"])
    if settings.batch_size != "auto":  # auto: chosen for this world in build, checked on load
        settings.batch_size, settings.accum_steps = elastic.split(saved, engine.world_size, settings.batch_size,
                                                                  settings.accum_steps)
        record.config.update(batch_size=settings.batch_size, accum_steps=settings.accum_steps)
        now = elastic.current(engine, settings.batch_size, settings.accum_steps)
        saved_cfg, now_cfg = json.loads(json.dumps(checked["config"])), json.loads(json.dumps(record.config))
        elastic.accept(saved, now, saved_cfg, now_cfg)
        check_resume_config(saved_cfg, now_cfg)  # any other change: refused now, not after the setup
    finishing = check_steps(path, checked["step"], settings.max_steps, run_dir, export)
    if settings.batch_size != "auto":
        elastic.check_epoch_end(checked["meta"], now, settings.max_steps)
    format_of(engine).resuming(path, saved.world_size, (run_dir or path.parent) / "checkpoints")
    return Resumed(path, checked, saved, finishing)


def check_steps(path: Path, at: int, max_steps: int, run_dir: Path | None, export: bool = False) -> bool:
    """A run cannot go back: a checkpoint past ``max_steps`` is refused, one at it has nothing to do,
    unless it is this run directory's own final checkpoint and the run (``export``: one that writes
    its weights) never wrote them (killed between its final checkpoint and the export): True, the
    run then trains nothing and writes them from that checkpoint, as the run would have."""
    if at > max_steps:
        raise ConfigError("max_steps", f"max_steps={max_steps} is below the step of the checkpoint it resumes "
                          f"({at}, {path}): a run cannot go back", f"give max_steps above {at} to train further, "
                          f"or start a new run in a new directory to train {max_steps} steps")
    own = run_dir is not None and Path(path).resolve().is_relative_to(Path(run_dir).resolve())
    if at == max_steps and own and export and not exported(run_dir):
        log.warning("the run in %s trained to its last step (%d) but ended before it wrote its weights "
                    "(%s): writing them now from %s", run_dir, at, " or ".join(EXPORTS), path)
        return True
    if at == max_steps and own:
        raise NothingToDo(f"the run in {run_dir} is at step {at} already (max_steps={max_steps}), its files "
                          f"untouched; give max_steps above {at} to train further")
    if at == max_steps:  # a checkpoint of another run, into a new directory: which is left as it was (none)
        raise NothingToDo(f"the checkpoint {path} is at step {at} already (max_steps={max_steps}); nothing was "
                          f"written; give max_steps above {at} to train further")
    return False


def accepted_changes(checkpoints: Checkpoints, saved: dict, path: Path) -> list[str]:
    """Refuse a config change that alters the run (``ConfigError``); return the accepted ones.
    Another split of the same global batch on another number of processes, and a switch between
    the local engine, DDP and FSDP, are not changes of the run (``looplib.store.elastic``)."""
    if not checkpoints.config:  # no config known: nothing to compare
        return []
    saved, now = json.loads(json.dumps(saved)), json.loads(json.dumps(checkpoints.config))  # copies to edit
    meta = json.loads((Path(path) / "meta.json").read_text())
    engine = checkpoints.engine
    before = elastic.saved_geometry(path, meta, saved, engine.world_size)
    elastic.check_engine(before, engine, saved)
    after = elastic.current(engine, now.get("batch_size", before.batch_size),
                            now.get("accum_steps", before.accum_steps))
    elastic.accept(before, after, saved, now)
    accepted = check_resume_config(saved, now)
    identity.refuse(identity.read(path), checkpoints.identity, path)  # the same data and tokenizer, or none
    return accepted


def find(checkpoints: Checkpoints, where: Path, found: dict | None = None) -> Path | None:
    """The newest valid checkpoint at ``where`` for this model and engine (see ``find_checkpoint``)."""
    return find_checkpoint(where, model_to_check(checkpoints), None, found,
                           lambda saved, path: accepted_changes(checkpoints, saved, path))


def model_to_check(checkpoints: Checkpoints):
    """The model whose names and shapes a checkpoint's weights are checked against (whole tensors
    only: an FSDP model's are shards, checked by torch when they load)."""
    return checkpoints.parts.get("model") if checkpoints.io.name == "looplib" else None


def load(checkpoints: Checkpoints, path: Path, state: TrainState, checked: dict | None = None) -> list[str]:
    """Restore everything from ``path`` into the parts bound to ``checkpoints`` and ``state``, in
    whichever form it holds model and optimizer state (looplib's own, DCP shards, DeepSpeed's),
    at the same sample of the data on this run's processes. Returns the config changes accepted
    as safe. ``checked``: what ``inspect_checkpoint`` read from it (validated again here
    otherwise); nothing is loaded before it has passed."""
    try:
        if checked is None or "accepted" not in checked:  # the files checked, not yet the config and weights
            checked = inspect_checkpoint(path, model_to_check(checkpoints), None,
                                         lambda saved, where: accepted_changes(checkpoints, saved, where))
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{path} is not a valid checkpoint: {err}",
                          "resume from another checkpoint, or use resume=auto to take the newest valid one") from None
    p, engine = checkpoints.parts, checkpoints.engine
    saved = elastic.saved_geometry(path, checked["meta"], checked["config"], engine.world_size)
    # model, optimizer and loss scale in the checkpoint's format, by the engine's (looplib.store.formats:
    # whole tensors or DCP shards into the local engine, DDP or FSDP; DeepSpeed's only into DeepSpeed)
    blob = checkpoints.io.load(path, p, saved.format, checked["state"])
    p["scheduler"].load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"])
    pos, epochs = blob["position"], p["epochs"]
    epochs.restore(pos, saved.world_size, saved.batch_size)  # the same sample, in this run's micro-batches
    state.step, state.epoch, state.bad_streak = pos["step"], epochs.epoch, pos["bad_streak"]
    state.longest_streak = state.bad_streak
    state.batches_seen, state.extra = epochs.batches_seen, blob.get("extra", {})
    checkpoints.last_saved_step = state.step
    return checked["accepted"]


def resume(checkpoints: Checkpoints, state: TrainState, where: str, run_dir: Path, max_steps: int,
           resumed: Resumed | None = None) -> None:
    """``resume=auto``: the newest valid checkpoint of this run directory (none: start afresh);
    ``resume=PATH``: a checkpoint, or a run directory holding some. Invalid checkpoints (see
    ``checkpoint_dir.inspect_checkpoint``) are skipped with a warning, or refused when named directly.
    ``resumed``: the checkpoint found before the run was built (``plan``). A checkpoint at
    ``max_steps`` already is ``NothingToDo``, one past it a ``ConfigError``: both before anything
    is loaded or written (``plan`` says so before anything is built)."""
    resumed = resumed or Resumed(*locate(where, run_dir))
    path = resumed.path
    if path is None:  # resume=auto (locate refused a PATH that holds none)
        log.warning("resume=auto: no valid checkpoint in %s yet, starting at step 0 (to continue an earlier "
                    "run, give its directory as the run directory)", run_dir)
    else:
        if not resumed.finishing:
            check_steps(path, resumed.checked["step"], max_steps, run_dir)
        checked = judged(checkpoints, path, resumed.checked)
        if checkpoints.geometry:  # what the processes changed (batch_size=auto: chosen since plan)
            saved = elastic.saved_geometry(path, checked["meta"], checked["config"], checkpoints.engine.world_size)
            line = elastic.what_changed(saved, elastic.Geometry(**{k: v for k, v in checkpoints.geometry.items()
                                                                   if k != "global_batch"}))
            if line:
                log.info("resume: %s", line)
        accepted = load(checkpoints, path, state, checked)
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


def judged(checkpoints: Checkpoints, path: Path, checked: dict) -> dict:
    """``checked`` (its files checked before the run was built) with the config judged against
    this run's (the batch chosen by ``batch_size=auto`` is known only now) and the weights'
    names and shapes against the model."""
    model = model_to_check(checkpoints)
    try:
        if model is not None and checked["state"] is not None:
            check_weights(path / "model.safetensors", unwrap(model))
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{path} is not a valid checkpoint: {err}",
                          "resume from another checkpoint, or use resume=auto to take the newest valid one") from None
    return {**checked, "accepted": accepted_changes(checkpoints, checked["config"], path)}
