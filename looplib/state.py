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
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError

log = logging.getLogger("looplib")

EXIT_PREEMPTED = 75     # EX_TEMPFAIL: a scheduler may requeue the job; resume=auto continues it
EXIT_NUMERIC = 3        # max_bad_steps consecutive non-finite steps: the run cannot go on
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
    preempted: bool = False  # stopped early by SIGTERM/SIGUSR1, after saving
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


class Preemption:
    """SIGTERM and SIGUSR1 set a flag (no I/O in the handler); the loop acts on it at the next
    optimizer-step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        self.signum = signum

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    @property
    def requested(self) -> bool:
        return self.signum is not None


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


def is_valid(path: Path) -> str | None:
    """None if ``path`` is a complete checkpoint, else why not."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return "no manifest (an interrupted write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable manifest ({err})"
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['size']}"
        if sha256(f) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest first (valid or not)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted(dirs, key=lambda p: p.name, reverse=True)


def find_checkpoint(where: Path) -> Path | None:
    """The newest valid checkpoint at ``where``: a checkpoint, its parent, or a run directory.
    Partial or corrupt ones are skipped with a warning."""
    where = Path(where)
    if (where / "manifest.json").exists() or where.name.startswith("step-"):
        candidates = [where]
    else:
        candidates = step_dirs(where / "checkpoints" if (where / "checkpoints").is_dir() else where)
    for path in candidates:
        problem = is_valid(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
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
    def save(self, state: TrainState) -> Path | None:
        """Write ``checkpoints/step-N`` (every rank calls this; who writes what is decided here)."""
        own_format = hasattr(self.engine, "save_checkpoint")  # DeepSpeed: ZeRO partitions per rank
        if self.root is None or state.step == self.last_saved_step:
            return None
        self.last_saved_step = state.step
        if not (self.is_main or own_format):
            return None
        t0 = time.perf_counter()
        p, epochs = self.parts, self.parts["epochs"]
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{state.step:08d}"
        position = {"step": state.step, "epoch": epochs.epoch, "batches_seen": epochs.batches_seen,
                    "bad_streak": int(state.bad_streak)}
        blob = {"format": FORMAT, "position": position, "scheduler": p["scheduler"].state_dict(),
                "rng": rng_state(), "extra": state.extra}
        if own_format:
            # The engine writes model, optimizer and loss scale in its own format, straight into
            # the final directory; the manifest written last still decides whether it counts.
            shutil.rmtree(final, ignore_errors=True)
            self.engine.save_checkpoint(self.root, client_state=blob, tag=final.name)
            if not self.is_main:
                return None
            tmp = final
        else:
            tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".tmp-{final.name}-"))
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
                "time": time.time()}
        write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        files = {str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": sha256(f)}
                 for f in sorted(tmp.rglob("*")) if f.is_file()}
        write_file(tmp / "manifest.json", json.dumps({"files": files}, indent=1).encode())  # last
        fsync_dir(tmp)
        if tmp != final:
            if final.exists():  # the same step saved again (e.g. after a resume): swap, then delete
                trash = final.with_name(f".old-{final.name}-{os.getpid()}")
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
        fsync_dir(self.root)
        self.rotate()
        self.save_seconds.append(time.perf_counter() - t0)
        log.info("checkpoint %s (%.1f MB, %.2f s)", final,
                 sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 2**20, self.save_seconds[-1])
        return final

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
    def load(self, path: Path, state: TrainState) -> list[str]:
        """Restore everything from ``path`` into the bound parts and ``state``. Returns the
        config changes accepted as safe."""
        from omegaconf import OmegaConf
        from safetensors.torch import load_model

        saved_cfg = OmegaConf.to_container(OmegaConf.create((path / "config.yaml").read_text()))
        now_cfg = OmegaConf.to_container(OmegaConf.create(self.config_yaml))
        # an engine may accept a change the saved config alone cannot judge (FSDP: another
        # number of processes splitting the same global batch differently)
        reshard = getattr(self.engine, "resume_config", None)
        accepted = (reshard(saved_cfg, now_cfg, path) if reshard else []) + check_resume_config(saved_cfg, now_cfg)
        p = self.parts
        if hasattr(self.engine, "load_checkpoint"):  # the engine's own format (DeepSpeed)
            blob = self.engine.load_checkpoint(path.parent, tag=path.name)
        else:
            blob = load_state(path / "state.pt")
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


def load_state(path: Path) -> dict:
    """``torch.load`` with ``weights_only=True``: tensors and plain containers, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ConfigError("resume", f"{path} holds objects other than tensors and plain containers "
                          f"and was not unpickled ({str(err).splitlines()[0]})",
                          "resume from a checkpoint looplib wrote, or delete this one") from None
