"""Saving the run: when and what to save, written atomically, rotated; and the bad-step stop rule.

(Not activation checkpointing, the activation memory of ``looplib.activations``.)

A checkpoint is a directory ``checkpoints/step-00000120/`` of five files (what each holds:
``looplib.store.checkpoint_dir``, which reads and checks them; loading one and what a resume
accepts: ``looplib.store.resume``). It is written into a temporary directory beside its final place, each
file flushed to disk, then renamed: a directory without a valid manifest is not a checkpoint,
and the previous checkpoints are deleted only after the new one is complete.

With ``checkpoint.async=true`` the same files are written by a thread from a copy of the state
taken at the step boundary (``looplib.store.background``): the loop waits only for the copy.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from ..atomic import as_umask, fsync_dir, make_dir_beside, write_file
from ..engines.local import Engine
from ..errors import NumericError, SaveError
from ..train_state import TrainState
from .background import Background, Stager, hold_for_test
from .checkpoint_dir import FORMAT, LOCAL_FILES, config_hash, config_text, rng_state, sha256, step_dirs, unwrap
from .formats import of as format_of
from ..run.signals import Signals, held

log = logging.getLogger("looplib")

class Checkpoints:
    """When to save, what to save, when to stop. The loop calls ``after_step`` once per step.

    ``every_steps=0`` saves only at the end (and on preemption). A null object for the loop:
    ``Checkpoints(None)`` never writes, yet still applies the bad-step rule.
    """

    def __init__(self, root: str | Path | None, every_steps: int = 0, keep: int = 2,
                 max_bad_steps: int = 0, config: dict | None = None, is_main: bool = True, engine: Engine | None = None,
                 check_every: int = 1, asynchronous: bool = False):
        self.root = Path(root) if root else None
        self.every, self.keep, self.max_bad = every_steps, keep, max_bad_steps
        self.check_every = max(1, check_every)
        self.config, self.is_main = config, is_main  # the run's config: written with each checkpoint
        self.engine: Engine = engine if engine is not None else Engine("cpu")
        self.preemption: Signals | None = None
        self.parts: dict = {}
        self.identity: dict | None = None   # the data's fingerprint (Corpus.fingerprint): compared on resume
        self.files: dict[str, bytes] = {}   # carried by every checkpoint (the tokenizer trained on the data)
        self.last_saved_step = -1
        self.save_seconds: list[float] = []  # the time each save held the loop up (the stall)
        # checkpoint.async: the write in flight (None: every checkpoint is written before the loop goes on)
        self.background = Background() if asynchronous and self.root is not None else None
        self.stager: Stager | None = None  # made at the first asynchronous save
        self.geometry: dict = {}  # engine, processes, batch_size, accum_steps (looplib.store.elastic.Geometry)

    def bind(self, *, model, optimizer, scheduler, precision, epochs, preemption=None) -> "Checkpoints":
        self.parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, precision=precision,
                          epochs=epochs)
        self.preemption = preemption
        return self

    # ------------------------------------------------------------------ the loop's one call
    def after_step(self, state: TrainState) -> bool:
        """Apply the bad-step rule, save when due or preempted. True: stop the loop now."""
        requested = self.preemption is not None and self.preemption.requested
        signalled = self.preemption is not None and self.preemption.signum is not None
        if self.background is not None:  # a failed background write is agreed with the stop, in one all-reduce
            stop, signalled, failed = self.engine.ranks.any_of(requested, signalled, self.background.failed)
            if failed:
                self.settle()  # raises SaveError on every rank
        elif self.preemption is not None:  # whether any rank was signalled too (not only stopped for a reason)
            stop, signalled = self.engine.ranks.any_of(requested, signalled)
        else:
            stop = False
        if stop and signalled:
            self.preemption.peer_signalled = True  # a rank without a signal of its own ends as the signalled one
        due = stop or bool(self.every and state.step % self.every == 0)
        # a streak counted on the device is read when saving and every check_every steps (the
        # logging steps, which sync anyway); one counted on the host, at every step
        if due or not torch.is_tensor(state.longest_streak) or state.step % self.check_every == 0:
            self.check_streak(state)
        if due and int(state.bad_streak) == 0:  # never replace a good checkpoint with a state after a bad step
            self.save(state)
        if stop:
            self.settle()  # a stop by signal waits for the write in flight
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
        self.settle()  # the run ends with its last checkpoint complete
        if self.stager is not None:  # the host copy is not needed any more (the export gathers next)
            self.stager.close()
            self.stager = None

    def check_streak(self, state: TrainState) -> None:
        if not self.max_bad:
            return
        longest = int(state.longest_streak)
        if longest >= self.max_bad:
            self.drain()  # the write in flight holds a good state: let it complete
            raise NumericError(f"{longest} consecutive steps had non-finite loss or gradients "
                               f"(max_bad_steps={self.max_bad}); stopped at step {state.step}, the last "
                               "good checkpoint is untouched. Lower lr, use bf16 instead of fp16, or clip "
                               "gradients (max_grad_norm)")

    def any_rank(self, flag: bool) -> bool:
        """The stop decision is agreed across ranks (one small all-reduce in multi-process runs)."""
        return self.engine.ranks.any(flag)

    # ------------------------------------------------------------------ writing
    @property
    def io(self):
        """The engine's checkpoint format (``looplib.store.formats``): what writes model and optimizer state."""
        return format_of(self.engine)

    @property
    def own_format(self) -> bool:
        return self.io.own_files  # FSDP, DeepSpeed: sharded, every rank writes its part

    def save(self, state: TrainState) -> Path | None:
        """Write ``checkpoints/step-N`` (every rank calls this; who writes what is decided here).
        The ranks then agree: none goes on (or reports the checkpoint) before the writers are
        done, and every rank stops if a write failed. Asynchronous: the write in flight is
        waited for first; this one is staged, and written in the background."""
        if self.root is None or state.step == self.last_saved_step:
            return None
        t0 = time.perf_counter()
        self.settle()  # at most one write in flight
        self.last_saved_step = state.step
        final, error = self.root / f"step-{state.step:08d}", None
        try:
            if self.is_main or self.own_format:
                self._write(state, final)
        except Exception as err:  # noqa: BLE001 - a full disk, a vanished directory, ...
            error = err
        if self.any_rank(error is not None):  # (a write this rank started is left to itself: under
            raise SaveError(final, error)    # FSDP it would wait for the rank that failed)
        if self.background is not None:
            self.background.path = final  # every rank knows what is in flight (DDP: rank 0 writes it)
        self.save_seconds.append(time.perf_counter() - t0)
        return final

    def settle(self) -> None:
        """Wait for the write in flight, if any; every rank agrees whether it failed (``SaveError``)."""
        if self.background is None:
            return
        error = self.background.wait()
        if self.any_rank(error is not None):
            raise SaveError(self.background.path, error)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the write in flight without agreeing (the run is ending for another reason; ``timeout``:
        at most so many seconds, for a write that could wait on a rank that is gone)."""
        error = self.background.wait(timeout) if self.background is not None else None
        if error is not None:
            log.error("could not write the checkpoint %s (%s: %s)", self.background.path, type(error).__name__, error)

    def _write(self, state: TrainState, final: Path) -> None:
        t0 = time.perf_counter()
        p, epochs = self.parts, self.parts["epochs"]
        self.root.mkdir(parents=True, exist_ok=True)
        position = {"step": state.step, **epochs.position(), "bad_streak": int(state.bad_streak)}
        blob = {"format": FORMAT, "position": position, "scheduler": p["scheduler"].state_dict(),
                "rng": rng_state(), "extra": state.extra}
        stage = self._stage if self.background is not None else None
        if self.own_format:
            # The format writes model, optimizer and loss scale itself, straight into the final
            # directory; the manifest written last still decides whether it counts.
            shutil.rmtree(final, ignore_errors=True)
            if stage is None:
                self.io.save(self.root, final.name, p, blob)
                engine_write = None
            else:  # staged here; its shards written by the thread, every rank's before rank 0's manifest
                engine_write = self.io.stage(self.root, final.name, p, stage(blob), stage)
            tmp, model, needs = final, None, None  # needs: the files the engine wrote, listed once written
        else:
            tmp, needs = make_dir_beside(final, f".tmp-{final.name}-"), list(LOCAL_FILES)
            model = unwrap(p["model"]).state_dict()
            blob.update(optimizer=p["optimizer"].state_dict(), precision=p["precision"].state_dict())
            if stage is not None:
                try:
                    model, blob = stage({"model": model, "blob": blob}).values()
                except BaseException:  # host memory ran out for the copy: no temporary stays
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise

        def write() -> None:
            start = t0 if stage is None else time.perf_counter()  # asynchronous: the thread's own time
            if self.own_format and stage is not None:
                engine_write()
            if not self.is_main:
                return
            try:
                self._fill(tmp, final, model, blob, position, needs)
            except BaseException:  # a full disk, a second Ctrl-C: no half-written directory stays
                if tmp != final or not (final / "manifest.json").exists():  # never a complete one
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            took = time.perf_counter() - start
            size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 2**20
            if stage is None:
                log.info("checkpoint %s (%.1f MB, %.2f s)", final, size, took)
            else:
                log.info("checkpoint %s (%.1f MB, written in the background in %.2f s)", final, size, took)

        if stage is None:
            write()
        else:
            self.background.start(final, write)

    def _stage(self, tree):
        """The state copied off the device (host memory the next step cannot change)."""
        if self.stager is None:
            self.stager = Stager(self.engine.device)
        return self.stager(tree)

    @property
    def write_seconds(self) -> list[float]:
        """Each background write's time (asynchronous checkpoints; empty otherwise)."""
        return self.background.seconds if self.background is not None else []

    def _fill(self, tmp: Path, final: Path, model: dict | None, blob: dict, position: dict,
              needs: list[str] | None) -> None:
        if tmp != final:
            from safetensors.torch import save_model
            save_model(_Weights(model), str(tmp / "model.safetensors"))  # tied weights stored once
            as_umask(tmp / "model.safetensors")  # safetensors writes 0600
            with open(tmp / "model.safetensors", "rb+") as f:
                os.fsync(f.fileno())
            with open(tmp / "state.pt", "wb") as f:
                torch.save(blob, f)
                f.flush()
                os.fsync(f.fileno())
        else:  # the engine's own files, as it wrote them
            needs = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        for name, data in self.files.items():
            write_file(tmp / name, data)
        text = config_text(self.config or {})
        write_file(tmp / "config.yaml", text.encode())
        meta = {**position, **({"geometry": self.geometry} if self.geometry else {}),
                "config_hash": config_hash(text), "torch": torch.__version__,
                "time": time.time(), "needs": needs}  # every file a resume reads: the manifest must list them
        if self.identity is not None:
            meta["identity"] = self.identity  # what the run was trained on (looplib.data.identity)
        write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        hold_for_test(position["step"])
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


class _Weights:
    """A state dict (staged or live) in the shape safetensors' ``save_model`` takes: it calls
    ``.state_dict()`` and stores tensors that share memory (tied weights) once, as for the module."""

    def __init__(self, weights: dict):
        self.weights = weights

    def state_dict(self) -> dict:
        return self.weights
