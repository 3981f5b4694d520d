"""Metrics: JSONL rows, a progress bar on a terminal (plain lines otherwise), throughput, memory.

Nothing here synchronises with the device except on logging steps: the loss is accumulated
as a device tensor and read (``.item()``, a host-device sync) once per ``log_every`` steps.
"""
from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("looplib")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this run: CUDA allocator peak on a GPU, process peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Telemetry:
    # Multi-process engines set this to their mean over ranks. A collective: every rank's
    # Telemetry (writing or not) reaches _log at the same steps.
    reduce_loss = staticmethod(lambda loss: loss)

    def __init__(self, path: str | Path | None = None, *, log_every: int = 10, total_steps: int = 0,
                 device: torch.device | str = "cpu", enabled: bool = True, progress: str = "auto"):
        self.path, self.log_every, self.total = path, max(1, log_every), total_steps
        self.device, self.enabled = torch.device(device), enabled
        self.file = open(path, "a", buffering=1) if (path and enabled) else None
        self.bar = None
        if enabled and (progress == "bar" or (progress == "auto" and sys.stderr.isatty())):
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self.optimizer_steps = 0      # real optimizer updates (a skipped fp16 step is not one)
        self.boundaries = 0           # accumulation windows closed
        self._loss, self._watched = None, None
        self._interval = {"steps": 0, "samples": 0, "items": 0}
        self._t0 = self._t_start = time.perf_counter()
        self.last_row: dict = {}

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Count real updates with an optimizer hook: no sync needed to know a step was skipped."""
        if self._watched is not optimizer:  # fit() may be called again to continue a run
            self._watched = optimizer
            optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_):
        self.optimizer_steps += 1

    def add(self, loss: torch.Tensor) -> None:
        """One micro-batch's share of the window loss (stays on the device)."""
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def step(self, step: int, epoch: int, window, lr: float, grad_norm: torch.Tensor | None) -> None:
        self.boundaries += 1
        iv = self._interval
        iv["steps"] += 1
        iv["samples"] += window.samples
        iv["items"] += window.items
        if self.bar is not None:
            self.bar.update(1)
        if step == 1 or step % self.log_every == 0 or step == self.total:
            self._log(step, epoch, lr, grad_norm)

    def _log(self, step, epoch, lr, grad_norm):
        loss = self.reduce_loss(self._loss).item() / self._interval["steps"]  # the sync point, once per log
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        iv = self._interval
        row = {"step": step, "epoch": epoch, "loss": loss, "lr": lr,
               "step_time_s": dt / iv["steps"], "samples_per_s": iv["samples"] / dt,
               "tokens_per_s": iv["items"] / dt, "skipped_steps": self.boundaries - self.optimizer_steps,
               "peak_mem_mb": round(peak_memory_mb(self.device), 1),
               "elapsed_s": now - self._t_start}
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        self.write(row)
        self._loss, self._t0 = None, time.perf_counter()
        self._interval = {"steps": 0, "samples": 0, "items": 0}
        text = f"loss {loss:.4f}  {row['tokens_per_s']:,.0f} tok/s  mem {row['peak_mem_mb']:,.0f} MB"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        elif self.enabled:
            log.info("step %d/%d  %s  lr %.3g", step, self.total, text, lr)

    def eval(self, step: int, loss: float) -> None:
        ppl = math.exp(loss) if loss < 50 else float("inf")
        self.write({"step": step, "eval_loss": loss, "eval_perplexity": ppl})
        msg = f"step {step}: eval loss {loss:.4f}, perplexity {ppl:.2f}"
        if self.enabled:
            (self.bar.write if self.bar is not None else log.info)(msg)

    def write(self, row: dict) -> None:
        self.last_row.update(row)
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
