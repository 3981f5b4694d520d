"""Checkpoints that survive any crash, exact resume, preemption and the bad-step stop rule.

A checkpoint is a directory ``checkpoints/step-00000120/`` holding

    model.safetensors   the weights (safetensors: no code runs when they are loaded)
    state.pt            optimizer, scheduler, precision (GradScaler) state, step/epoch/position,
                        RNG states: loaded with ``torch.load(weights_only=True)`` only
    config.yaml         the resolved config it was made with (and its hash in meta.json)
    meta.json           step, epoch, data position, config hash, looplib/torch versions
    manifest.json       written last: size and sha256 of every other file

It is written into a temporary directory beside its final place, each file flushed to disk,
then renamed: a directory without a valid manifest is not a checkpoint, and the previous
checkpoints are deleted only after the new one is complete.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError
from .signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, Signals, held  # noqa: F401 (re-exported)

log = logging.getLogger("looplib")

EXIT_NUMERIC = 3        # max_bad_steps consecutive non-finite steps: the run cannot go on
EXIT_IO = 74            # EX_IOERR: a checkpoint could not be written (a full disk, ...)
FORMAT = 1

# Keys whose change does not alter the training trajectory: accepted on resume, and reported.
SAFE_TO_CHANGE = ("max_steps", "log_every", "eval_every", "eval_batches", "sample_tokens", "progress",
                  "resume", "checkpoint", "max_bad_steps", "loader.num_workers", "loader.pin_memory",
                  "loader.persistent_workers", "loader.prefetch_factor", "hydra")


class NumericError(RuntimeError):
    """Too many consecutive steps with non-finite loss or gradients."""


@dataclass
class TrainState:
    step: int = 0            # optimizer-step boundaries reached (skipped steps included)
    epoch: int = 0           # epoch the data stream is in
    batches_seen: int = 0    # micro-batches consumed in that epoch (the resume position)
    bad_streak: int = 0      # consecutive boundaries without an optimizer update
    preempted: bool = False  # stopped early by a signal (SIGTERM, SIGUSR1, Ctrl-C), after saving
    extra: dict = field(default_factory=dict)
    # Skipped updates in this process, and the longest streak of them. Where a fused kernel
    # skipped on the device, these and bad_streak are device tensors, read when logging or saving.
    skipped: int | torch.Tensor = 0
    longest_streak: int | torch.Tensor = 0

    def end_window(self, epochs, updated: bool, skipped: torch.Tensor | None = None) -> None:
        """One optimizer-step boundary passed. ``updated``: the optimizer's hooks saw an update;
        ``skipped``: a device flag that overrides them (1.0: a fused kernel skipped the update)."""
        self.step += 1
        self.epoch, self.batches_seen = epochs.epoch, epochs.batches_seen
        if skipped is None:
            self.bad_streak = 0 if updated else self.bad_streak + 1
            self.skipped += not updated
            self.longest_streak = max(self.longest_streak, self.bad_streak)
        else:  # the same arithmetic on the device: no host-device sync
            self.bad_streak = (self.bad_streak + 1) * skipped
            self.skipped = self.skipped + skipped
            self.longest_streak = (torch.maximum(self.longest_streak, self.bad_streak)
                                   if torch.is_tensor(self.longest_streak)
                                   else self.bad_streak.clamp(min=self.longest_streak))


Preemption = Signals  # the run's signal handler (looplib.signals): SIGTERM, SIGUSR1 and Ctrl-C


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # only if something uses it; kept as plain tensors and ints
        kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


LOCAL_FILES = ("model.safetensors", "state.pt")   # what a checkpoint in looplib's own format needs
ALWAYS = ("config.yaml", "meta.json")


class InvalidCheckpoint(Exception):
    """A directory that is not a complete, readable checkpoint; ``str(err)`` says why."""


def inspect_checkpoint(path: Path, model: torch.nn.Module | None = None, own_format: bool | None = None,
                       check_config=None) -> dict:
    """The one validation every checkpoint goes through before anything is loaded from it.

    Checks, in order of cost: a directory with a manifest of the right shape that lists every
    file a checkpoint needs (looplib's own, or those the engine wrote, named in meta.json); each
    file's size and sha256; config.yaml and meta.json parse; state.pt unpickles with
    ``weights_only=True``; the weights' names, shapes and dtypes fit ``model``. Given
    ``check_config(saved_config, path)``, a config change that would alter the run is refused
    (``ConfigError``, not skipped) before the weights are compared, so that the message names
    the setting. Returns what was
    read (``config``, ``meta``, ``state``) so that loading does not read it twice; raises
    ``InvalidCheckpoint`` naming the first problem."""
    path = Path(path)
    if not path.is_dir():
        raise InvalidCheckpoint("not a directory" if path.exists() else "does not exist")
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise InvalidCheckpoint("no manifest (an interrupted write)")
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(str(name), int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InvalidCheckpoint(f"unreadable manifest ({type(err).__name__}: {err})") from None
    for name, size, digest in entries:
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise InvalidCheckpoint(f"the manifest names {name}, outside the checkpoint")
        if not f.is_file():
            raise InvalidCheckpoint(f"{name} is missing")
        if f.stat().st_size != size:
            raise InvalidCheckpoint(f"{name} has {f.stat().st_size} bytes, the manifest says {size}")
        if sha256(f) != digest:
            raise InvalidCheckpoint(f"{name} does not match its checksum")
    unlisted = [name for name in ALWAYS if name not in files]
    if unlisted:
        raise InvalidCheckpoint(f"the manifest does not list {', '.join(unlisted)}")
    try:
        meta = json.loads((path / "meta.json").read_text())
        step = int(meta["step"])
        if not isinstance(meta.get("needs", []), list):
            raise TypeError("needs is not a list")
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidCheckpoint(f"unreadable meta.json ({type(err).__name__}: {err})") from None
    if own_format is None:  # not told which engine reads it: what the checkpoint says it needs
        own_format = "needs" in meta and "state.pt" not in meta["needs"]
    needs = set(ALWAYS) | set(meta.get("needs", ())) | (set() if own_format else set(LOCAL_FILES))
    unlisted = sorted(needs - set(files))
    if unlisted:
        raise InvalidCheckpoint(f"the manifest does not list {', '.join(unlisted)}")
    try:
        from omegaconf import OmegaConf
        saved = OmegaConf.to_container(OmegaConf.create((path / "config.yaml").read_text()))
        if not isinstance(saved, dict):
            raise ValueError("not a mapping")
    except Exception as err:  # noqa: BLE001 - yaml's and OmegaConf's many errors
        raise InvalidCheckpoint(f"unreadable config.yaml ({str(err).splitlines()[0]})") from None
    out = {"config": saved, "meta": meta, "step": step, "state": None,
           "accepted": check_config(saved, path) if check_config is not None else []}
    if own_format:  # the engine reads its own files (DeepSpeed checks its partitions itself)
        return out
    out["state"] = read_state(path / "state.pt")
    missing = [k for k in ("position", "scheduler", "rng", "optimizer", "precision") if k not in out["state"]]
    if missing:
        raise InvalidCheckpoint(f"state.pt lacks {', '.join(missing)}")
    if model is not None:
        check_weights(path / "model.safetensors", unwrap(model))
    return out


def read_state(path: Path) -> dict:
    """``torch.load`` with ``weights_only=True``: tensors and plain containers, never code."""
    try:
        with warnings.catch_warnings():  # torch's "Detected pickle protocol N" note: the refusal below says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise InvalidCheckpoint(f"state.pt holds objects other than tensors and plain containers and was "
                                f"not unpickled ({str(err).splitlines()[0]})") from None
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file
        raise InvalidCheckpoint(f"unreadable state.pt ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not isinstance(blob, dict):
        raise InvalidCheckpoint(f"{path.name} does not hold a mapping")
    return blob


def check_weights(path: Path, model: torch.nn.Module) -> None:
    """Names, shapes and dtypes of the saved tensors against ``model``, read from the file's
    header only (nothing is loaded, so a mismatch leaves the model untouched)."""
    from safetensors import safe_open
    from safetensors.torch import _TYPES
    own = model.state_dict()
    try:
        with safe_open(str(path), framework="pt") as f:
            saved = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as err:  # noqa: BLE001
        raise InvalidCheckpoint(f"unreadable model.safetensors ({str(err).splitlines()[0]})") from None
    for key, (shape, dtype) in saved.items():
        if key not in own:
            raise InvalidCheckpoint(f"model.safetensors holds {key}, which this model does not have "
                                    "(a checkpoint of another model)")
        if shape != tuple(own[key].shape) or _TYPES.get(dtype, own[key].dtype) != own[key].dtype:
            raise InvalidCheckpoint(f"model.safetensors holds {key} as {dtype}{list(shape)}, this model "
                                    f"has {own[key].dtype}{list(own[key].shape)} (a checkpoint of another model)")
    stored = {own[k].data_ptr() for k in saved}  # tied weights are stored once, under one name
    absent = [k for k in own if k not in saved and own[k].data_ptr() not in stored]
    if absent:
        raise InvalidCheckpoint(f"model.safetensors lacks {absent[0]}" + (f" and {len(absent) - 1} more"
                                                                          if len(absent) > 1 else ""))


def is_valid(path: Path, model: torch.nn.Module | None = None, own_format: bool | None = None) -> str | None:
    """None if ``path`` is a complete, readable checkpoint, else why not."""
    try:
        inspect_checkpoint(path, model, own_format)
    except InvalidCheckpoint as err:
        return str(err)
    return None


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest first (valid or not)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted(dirs, key=lambda p: p.name, reverse=True)


def find_checkpoint(where: Path, model: torch.nn.Module | None = None, own_format: bool | None = None,
                    found: dict | None = None, check_config=None) -> Path | None:
    """The newest valid checkpoint at ``where``: a checkpoint, its parent, or a run directory.
    Invalid ones are skipped with a warning; a single checkpoint named directly that is
    invalid raises ``InvalidCheckpoint``. ``found``, if given, receives what was read from the
    one returned (so that loading it does not read it again)."""
    where = Path(where)
    if (where / "manifest.json").exists() or where.name.startswith("step-") or where.is_file():
        candidates, single = [where], True
    else:
        candidates, single = step_dirs(where / "checkpoints" if (where / "checkpoints").is_dir() else where), False
    for path in candidates:
        try:
            checked = inspect_checkpoint(path, model, own_format, check_config)
        except InvalidCheckpoint as err:
            if single:
                raise
            log.warning("skipping checkpoint %s: %s", path, err)
            continue
        if found is not None:
            found[path] = checked
        return path
    return None


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


class Checkpoints:
    """When to save, what to save, when to stop. The loop calls ``after_step`` once per step.

    ``every_steps=0`` saves only at the end (and on preemption). A null object for the loop:
    ``Checkpoints(None)`` never writes, yet still applies the bad-step rule.
    """

    def __init__(self, root: str | Path | None, every_steps: int = 0, keep: int = 2,
                 max_bad_steps: int = 0, config_yaml: str = "", is_main: bool = True, engine=None,
                 check_every: int = 1):
        self.root = Path(root) if root else None
        self.every, self.keep, self.max_bad = every_steps, keep, max_bad_steps
        self.check_every = max(1, check_every)
        self.config_yaml, self.is_main, self.engine = config_yaml, is_main, engine
        self.preemption: Preemption | None = None
        self.parts: dict = {}
        self.last_saved_step = -1
        self.save_seconds: list[float] = []

    def bind(self, *, model, optimizer, scheduler, precision, epochs, preemption=None) -> "Checkpoints":
        self.parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, precision=precision,
                          epochs=epochs)
        self.preemption = preemption
        return self

    # ------------------------------------------------------------------ the loop's one call
    def after_step(self, state: TrainState) -> bool:
        """Apply the bad-step rule, save when due or preempted. True: stop the loop now."""
        stop = self.preemption is not None and self.any_rank(self.preemption.requested)
        due = stop or bool(self.every and state.step % self.every == 0)
        # a streak counted on the device is read when saving and every check_every steps (the
        # logging steps, which sync anyway); one counted on the host, at every step
        if due or not torch.is_tensor(state.longest_streak) or state.step % self.check_every == 0:
            self.check_streak(state)
        if due and int(state.bad_streak) == 0:  # never replace a good checkpoint with a state after a bad step
            self.save(state)
        state.preempted = stop
        return stop

    def finish(self, state: TrainState) -> None:
        """The end of a run: the bad-step rule once more (a streak counted on the device was last
        read at a logging step), then the final checkpoint, unless the last step was skipped."""
        self.check_streak(state)
        if int(state.bad_streak) == 0:
            self.save(state)
        else:
            log.warning("the last %d step(s) were skipped (non-finite): no final checkpoint, the newest "
                        "good one stays", int(state.bad_streak))

    def check_streak(self, state: TrainState) -> None:
        if not self.max_bad:
            return
        longest = int(state.longest_streak)
        if longest >= self.max_bad:
            raise NumericError(f"{longest} consecutive steps had non-finite loss or gradients "
                               f"(max_bad_steps={self.max_bad}); stopped at step {state.step}, the last "
                               "good checkpoint is untouched. Lower lr, use bf16 instead of fp16, or clip "
                               "gradients (max_grad_norm)")

    def any_rank(self, flag: bool) -> bool:
        """The stop decision is agreed across ranks (one small all-reduce in multi-process runs)."""
        agree = getattr(self.engine, "any_rank", None)
        return agree(flag) if agree is not None else flag

    # ------------------------------------------------------------------ writing
    @property
    def own_format(self) -> bool:
        return hasattr(self.engine, "save_checkpoint")  # DeepSpeed: ZeRO partitions per rank

    def save(self, state: TrainState) -> Path | None:
        """Write ``checkpoints/step-N`` (every rank calls this; who writes what is decided here).
        The ranks then agree: none goes on (or reports the checkpoint) before the writers are
        done, and every rank stops if a write failed."""
        if self.root is None or state.step == self.last_saved_step:
            return None
        self.last_saved_step = state.step
        final, error = self.root / f"step-{state.step:08d}", None
        try:
            if self.is_main or self.own_format:
                self._write(state, final)
        except Exception as err:  # noqa: BLE001 - a full disk, a vanished directory, ...
            error = err
        if self.any_rank(error is not None):
            raise SaveError(final, error)
        return final

    def _write(self, state: TrainState, final: Path) -> None:
        t0 = time.perf_counter()
        p, epochs = self.parts, self.parts["epochs"]
        self.root.mkdir(parents=True, exist_ok=True)
        position = {"step": state.step, "epoch": epochs.epoch, "batches_seen": epochs.batches_seen,
                    "bad_streak": int(state.bad_streak)}
        blob = {"format": FORMAT, "position": position, "scheduler": p["scheduler"].state_dict(),
                "rng": rng_state(), "extra": state.extra}
        if self.own_format:
            # The engine writes model, optimizer and loss scale in its own format, straight into
            # the final directory; the manifest written last still decides whether it counts.
            shutil.rmtree(final, ignore_errors=True)
            self.engine.save_checkpoint(self.root, client_state=blob, tag=final.name)
            if not self.is_main:
                return
            tmp = final
            needs = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        else:
            tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".tmp-{final.name}-"))
            needs = list(LOCAL_FILES)
        try:
            self._fill(tmp, final, blob, position, needs)
        except BaseException:  # a full disk, a second Ctrl-C: no half-written directory stays
            if tmp != final or not (final / "manifest.json").exists():  # never a complete one
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.save_seconds.append(time.perf_counter() - t0)
        log.info("checkpoint %s (%.1f MB, %.2f s)", final,
                 sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 2**20, self.save_seconds[-1])

    def _fill(self, tmp: Path, final: Path, blob: dict, position: dict, needs: list[str]) -> None:
        if tmp != final:
            p = self.parts
            from safetensors.torch import save_model
            save_model(unwrap(p["model"]), str(tmp / "model.safetensors"))
            with open(tmp / "model.safetensors", "rb+") as f:
                os.fsync(f.fileno())
            blob.update(optimizer=p["optimizer"].state_dict(), precision=p["precision"].state_dict())
            with open(tmp / "state.pt", "wb") as f:
                torch.save(blob, f)
                f.flush()
                os.fsync(f.fileno())
        write_file(tmp / "config.yaml", self.config_yaml.encode())
        meta = {**position, "config_hash": config_hash(self.config_yaml), "torch": torch.__version__,
                "time": time.time(), "needs": needs}  # every file a resume reads: the manifest must list them
        write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        files = {str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": sha256(f)}
                 for f in sorted(tmp.rglob("*")) if f.is_file()}
        write_file(tmp / "manifest.json", json.dumps({"files": files}, indent=1).encode())  # last
        fsync_dir(tmp)
        if tmp != final:
            with held():  # no signal between the two renames of a swap
                if final.exists():  # the same step saved again (e.g. after a resume): swap, then delete
                    trash = final.with_name(f".old-{final.name}-{os.getpid()}")
                    os.rename(final, trash)
                    os.rename(tmp, final)
                    shutil.rmtree(trash, ignore_errors=True)
                else:
                    os.rename(tmp, final)
        fsync_dir(self.root)
        self.rotate()

    def rotate(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; remove older ones, partial ones older
        than the newest complete one, and stale temporaries. (Complete = its manifest, written
        last, exists: checksums are verified on resume, not re-hashed at every save.)"""
        dirs = step_dirs(self.root)
        complete = [d for d in dirs if (d / "manifest.json").is_file()]
        doomed = complete[self.keep:]
        if complete:
            doomed += [d for d in dirs if d not in complete and d.name < complete[0].name]
        for old in doomed:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ reading
    def find(self, where: Path, found: dict | None = None) -> Path | None:
        """The newest valid checkpoint at ``where`` for this model and engine (see ``find_checkpoint``)."""
        return find_checkpoint(where, self.parts.get("model"), self.own_format, found, self.check_config)

    def check_config(self, saved_cfg: dict, path: Path) -> list[str]:
        """Refuse a config change that alters the run (``ConfigError``); return the accepted ones.
        An engine may accept a change the saved config alone cannot judge (FSDP: another number
        of processes splitting the same global batch differently)."""
        from omegaconf import OmegaConf
        if not self.config_yaml.strip():  # no config known: nothing to compare
            return []
        now_cfg = OmegaConf.to_container(OmegaConf.create(self.config_yaml))
        reshard = getattr(self.engine, "resume_config", None)
        return (reshard(saved_cfg, now_cfg, path) if reshard else []) + check_resume_config(saved_cfg, now_cfg)

    def load(self, path: Path, state: TrainState, checked: dict | None = None) -> list[str]:
        """Restore everything from ``path`` into the bound parts and ``state``. Returns the
        config changes accepted as safe. ``checked``: what ``inspect_checkpoint`` read from it
        (validated again here otherwise); nothing is loaded before it has passed."""
        from safetensors.torch import load_model

        try:
            checked = checked or inspect_checkpoint(path, self.parts.get("model"), self.own_format, self.check_config)
        except InvalidCheckpoint as err:
            raise ConfigError("resume", f"{path} is not a valid checkpoint: {err}",
                              "resume from another checkpoint, or use resume=auto to take the newest valid one") from None
        accepted = checked["accepted"]
        p = self.parts
        if self.own_format:  # the engine's own format (DeepSpeed)
            blob = self.engine.load_checkpoint(path.parent, tag=path.name)
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
        self.last_saved_step = state.step
        return accepted


class SaveError(RuntimeError):
    """A checkpoint could not be written (on this rank or another); the last complete one stays."""

    def __init__(self, path: Path, cause: Exception | None):
        self.path, self.cause = path, cause
        why = f"{type(cause).__name__}: {cause}" if cause is not None else "another rank failed to write its part"
        super().__init__(f"could not write the checkpoint {path} ({why})")


def load_state(path: Path) -> dict:
    """``torch.load`` with ``weights_only=True`` (see ``read_state``), refused with one line."""
    try:
        return read_state(path)
    except InvalidCheckpoint as err:
        raise ConfigError("resume", f"{path}: {err}", "resume from a checkpoint looplib wrote, or delete this one") from None
