"""Checkpoints written in the background (``checkpoint.async=true``): the loop waits only while the
state is copied off the device; a thread writes the copy while training goes on.

    stage (the loop waits)   model, optimizer, loss scale, schedule, RNG and data position copied
                             into host memory with torch's ``DefaultStager``: pinned memory on CUDA
                             (non-blocking device-to-host copies, then one sync), a copy on the CPU
                             (the next optimizer step updates the weights in place, never the
                             bytes being written). The staging buffers are kept and reused, so the
                             run holds one more copy of its checkpointed state in host memory.
    write (a thread)         the same files as a synchronous checkpoint, from the copy, manifest
                             last (``looplib.store.saving``); FSDP's shards through DCP on a process
                             group of their own (``looplib.store.formats.Sharded``).

At most one write is in flight: the next checkpoint, the end of the run and a stop by signal
wait for it (``Background.wait``); a failed write is kept and reported at the next step
boundary. The thread is a daemon: a second Ctrl-C or a lost rank ends the process at once, and
the write it cut short never counts (it has no manifest), as after SIGKILL.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("looplib")

HOLD = "LOOPLIB_TEST_HOLD_CHECKPOINT"  # tests only: a step whose write stops before its manifest


class Stager:
    """Copies a tree of state (dicts, lists, tensors, DTensor shards, plain values) into host
    memory the training step cannot touch: torch's ``DefaultStager``, pinned on CUDA. Storages
    shared in the tree stay shared in the copy (tied weights are still stored once), and each
    source storage keeps its buffer from one checkpoint to the next."""

    def __init__(self, device: torch.device):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        cuda = torch.device(device).type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))

    def __call__(self, tree):
        return self.stager.stage(tree)

    def close(self) -> None:
        self.stager.close()


class Background:
    """One write at a time, on a daemon thread; its error kept until someone asks."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.path: Path | None = None          # the checkpoint in flight (or last written)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.seconds: list[float] = []         # each write's time in the background

    def start(self, path: Path, write: Callable[[], None]) -> None:
        assert self.thread is None, "a checkpoint write is already in flight"
        self.path, self.error = path, None
        self.done.clear()

        def run():
            t0 = time.perf_counter()
            try:
                write()
                self.seconds.append(time.perf_counter() - t0)
            except BaseException as err:  # noqa: BLE001 - kept, and raised on the loop's thread
                self.error = err
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, name=f"looplib-checkpoint-{path.name}", daemon=True)
        self.thread.start()

    @property
    def failed(self) -> bool:
        """The write in flight has ended with an error (never blocks)."""
        return self.done.is_set() and self.error is not None

    def wait(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the write in flight (if any; ``timeout``: at most so many seconds, after which it
        is left to itself and said); its error, or None."""
        if self.thread is None:
            return None
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("the checkpoint write of %s did not end within %.0f s; it is left unfinished (it does "
                        "not count: resume=auto takes the last complete checkpoint)", self.path, timeout)
            return None
        self.thread = None
        error, self.error = self.error, None
        return error


def hold_for_test(step: int) -> None:
    """Tests only (``LOOPLIB_TEST_HOLD_CHECKPOINT=N``): the write of step N stops for good after its
    files and before its manifest, so a test can kill the run while that write is in flight."""
    if os.environ.get(HOLD) == str(step):
        log.warning("holding the checkpoint write of step %d before its manifest (%s)", step, HOLD)
        threading.Event().wait()
