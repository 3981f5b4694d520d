"""Saving the run: when and what to save, written atomically, rotated; and the bad-step stop rule.

(Not activation checkpointing, which is ``looplib.checkpointing``.)

A checkpoint is a directory ``checkpoints/step-00000120/`` of five files (what each holds:
``looplib.checkpoint_files``, which reads and checks them; what a resume accepts:
``looplib.resume``). It is written into a temporary directory beside its final place, each
file flushed to disk, then renamed: a directory without a valid manifest is not a checkpoint,
and the previous checkpoints are deleted only after the new one is complete.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .checkpoint_files import (FORMAT, LOCAL_FILES, InvalidCheckpoint, config_hash, find_checkpoint, fsync_dir,
                               inspect_checkpoint, rng_state, set_rng_state, sha256, step_dirs, unwrap, write_file)
from .engines.local import Engine
from .errors import ConfigError
from .resume import check_resume_config
from .signals import Signals, held
from .train_state import TrainState

log = logging.getLogger("looplib")

EXIT_NUMERIC = 3        # max_bad_steps consecutive non-finite steps: the run cannot go on
EXIT_IO = 74            # EX_IOERR: a checkpoint could not be written (a full disk, ...)


class NumericError(RuntimeError):
    """Too many consecutive steps with non-finite loss or gradients."""


Preemption = Signals  # the run's signal handler (looplib.signals): SIGTERM, SIGUSR1 and Ctrl-C


class Checkpoints:
    """When to save, what to save, when to stop. The loop calls ``after_step`` once per step.

    ``every_steps=0`` saves only at the end (and on preemption). A null object for the loop:
    ``Checkpoints(None)`` never writes, yet still applies the bad-step rule.
    """

    def __init__(self, root: str | Path | None, every_steps: int = 0, keep: int = 2,
                 max_bad_steps: int = 0, config_yaml: str = "", is_main: bool = True, engine: Engine | None = None,
                 check_every: int = 1):
        self.root = Path(root) if root else None
        self.every, self.keep, self.max_bad = every_steps, keep, max_bad_steps
        self.check_every = max(1, check_every)
        self.config_yaml, self.is_main = config_yaml, is_main
        self.engine: Engine = engine if engine is not None else Engine("cpu")
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
        return self.engine.any_rank(flag)

    # ------------------------------------------------------------------ writing
    @property
    def own_format(self) -> bool:
        return self.engine.own_checkpoints  # FSDP, DeepSpeed: sharded, every rank writes its part

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
        return self.engine.resume_config(saved_cfg, now_cfg, path) + check_resume_config(saved_cfg, now_cfg)

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
