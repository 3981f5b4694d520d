"""Metrics: JSONL rows, a progress bar on a terminal (plain lines otherwise), throughput, memory.

Nothing here synchronises with the device except on logging steps: the loss is accumulated
as a device tensor and read (``.item()``, a host-device sync) once per ``log_every`` steps.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import math
import resource
import sys
import time
from pathlib import Path

import torch

from .loggers import JsonLines, Logger, Run

log = logging.getLogger("looplib")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this run: CUDA allocator peak on a GPU, process peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def host_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> str:
    """Start this job's memory peaks: a sweep (``-m``) runs its jobs one after another in one
    process, where a process-wide peak only ever rises in job order. Returns what
    ``peak_mem_mb`` then measures, in words (the first row of metrics.jsonl carries it, with
    ``mem_at_start_mb``: the same measure's value at the reset, so peak minus it is the job's rise)."""
    gc.collect()  # the previous job's objects, then its freed heap pages back to the OS (glibc keeps
    try:          # them otherwise, and this job would start from the last one's peak and reuse them unseen)
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:  # Linux: "5" resets the peak RSS (VmHWM, and getrusage's ru_maxrss) to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
        host = True
    except OSError:
        host = False
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return ("GPU memory allocated by torch tensors, peak during this job (torch.cuda.max_memory_allocated; "
                "without the CUDA context and the allocator's cached blocks)")
    if host:
        return ("process resident memory (RSS), peak during this job (the peak is reset when the job starts, "
                "after freed memory is handed back to the OS; it includes what the process still holds: Python, "
                "torch, the libraries, the job's model)")
    return "process resident memory (RSS), peak since the process began (could not be reset per job)"


def device_uuid(device: torch.device) -> str | None:
    """The NVML name of a CUDA device. torch numbers devices after CUDA_VISIBLE_DEVICES and NVML
    does not, so the device is found by its UUID, never by its index."""
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except (AssertionError, RuntimeError, AttributeError):
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


@functools.lru_cache(maxsize=None)
def nvml_handle(uuid: str | None):
    """(pynvml, handle) for the device with this UUID, or None (no GPU, driver or library)."""
    try:
        import pynvml  # nvidia-ml-py
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:  # noqa: BLE001 - degrade silently: the row just lacks the key
        return None


def nvml_used_mb(device: torch.device) -> float | None:
    """Device memory in use according to the driver (all processes, the CUDA context included:
    what nvidia-smi and the guides' print_gpu_utilization() show). None without a GPU or NVML."""
    if device.type != "cuda":
        return None
    found = nvml_handle(device_uuid(device))
    if found is None:
        return None
    pynvml, handle = found
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
    except Exception:  # noqa: BLE001
        return None


# Dense peak TFLOP/s by device name and precision, for MFU when peak_tflops is not given.
PEAK_TFLOPS = {  # name fragment: (16-bit tensor cores, tf32, fp32)
    "H200": (989.0, 494.0, 67.0), "H100 PCIe": (756.0, 378.0, 51.0), "H100": (989.0, 494.0, 67.0),
    "A100": (312.0, 156.0, 19.5), "V100": (125.0, 15.7, 15.7),
}


def peak_flops(device: torch.device, precision: str, given_tflops: float | None = None) -> float | None:
    """Peak FLOP/s for MFU: ``peak_tflops`` when given, else known GPUs by name, else None."""
    if given_tflops:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    column = {"bf16": 0, "fp16": 0, "fp8": 0, "tf32": 1}.get(precision, 2)  # fp8: MFU against the bf16 peak
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in name:
            return peaks[column] * 1e12
    return None


UNITS = {"tokens": "tok", "sequences": "seq"}   # the progress line's short names (others as counted: pairs/s)


class Telemetry:
    # Multi-process engines set this to their mean over ranks. A collective: every rank's
    # Telemetry (writing or not) reaches _log at the same steps.
    reduce_loss = staticmethod(lambda loss: loss)
    items = "tokens"   # what the objective counts (classification: sequences): <items>_per_s
    # what compiling has cost so far (looplib.compile's report: cumulative compile_s, compiles), written
    # with every row so that a recompile shows where it happened; {} when nothing is compiled
    compiled = staticmethod(lambda: {})
    about: dict = {}   # facts about the run said once, in the first row (the model's dropout)
    # the objective's own metrics since the last row (a preference objective's rewards), on every logging step
    objective_metrics = staticmethod(lambda: {})

    def __init__(self, path: str | Path | None = None, *, log_every: int = 10, total_steps: int = 0,
                 device: torch.device | str = "cpu", enabled: bool = True, progress: str = "auto",
                 flops_per_sample: float | None = None, peak_flops: float | None = None,
                 logger: Logger | None = None, run: Run | None = None):
        """``logger`` (looplib.loggers): trackers that get every row too, started with ``run``
        and finished by ``finish``/``close``; only when ``enabled`` (rank 0)."""
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self._data, self._wait0 = None, 0.0
        self.path, self.log_every, self.total = path, max(1, log_every), total_steps
        self.device, self.enabled = torch.device(device), enabled
        self.jsonl = JsonLines(path) if (path and enabled) else Logger()
        self.logger = (logger or Logger()) if enabled else Logger()
        self.logger.start(run or Run(Path(path).parent if path else Path.cwd(), {}, "run"))
        self._finished = False
        self.bar, self._redirect = None, contextlib.ExitStack()
        if enabled and (progress == "bar" or (progress == "auto" and sys.stderr.isatty())):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
            # Log lines (Hydra prints them to stdout) go above the bar, not through it.
            consoles = [lg for lg in (logging.getLogger(), log) if any(
                isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr) for h in lg.handlers)]
            self._redirect.enter_context(logging_redirect_tqdm(consoles))
            from .data.progress import bar_size  # (a pseudo-terminal of size 0 x 0 hid the bar)
            self.bar = tqdm(total=total_steps, unit="step", **bar_size())
        self.optimizer_steps = 0      # real optimizer updates (a skipped fp16 step is not one)
        self.boundaries = 0           # accumulation windows closed
        self._loss, self._watched, self._seen = None, None, 0
        self._interval = {"steps": 0, "samples": 0, "items": 0}
        self._t0 = self._t_start = self._stepped_at = time.perf_counter()
        self._started_at = time.time()  # wall clock at the start of training (first row: started_at)
        self.last_row: dict = {}
        self.resumed_from: int | None = None  # marks the first row after a resume
        self._memory = reset_peak_memory(self.device) if enabled else None  # said once, in the first row
        self._mem_at_start = round(peak_memory_mb(self.device), 1) if enabled else None

    def watch(self, optimizer: torch.optim.Optimizer, data=None) -> None:
        """Count real updates with an optimizer hook: no sync needed to know a step was skipped.
        ``data`` (an ``Epochs``) reports the time spent waiting for batches."""
        if data is not None and data is not self._data:
            self._data, self._wait0 = data, getattr(data, "wait_s", 0.0)
        if self._watched is not optimizer:  # fit() may be called again to continue a run
            self._watched = optimizer
            optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_):
        self.optimizer_steps += 1

    def updated(self) -> bool:
        """Whether the optimizer stepped since the last call (False: the step was skipped)."""
        stepped, self._seen = self.optimizer_steps > self._seen, self.optimizer_steps
        return stepped

    def add(self, loss: torch.Tensor) -> None:
        """One micro-batch's share of the window loss (stays on the device)."""
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def step(self, step: int, epoch: int, window, lr: float, grad_norm: torch.Tensor | None,
             skipped: int | torch.Tensor | None = None) -> None:
        """One optimizer step closed; a row every ``log_every`` steps. ``skipped``: updates skipped
        so far (a device tensor where fused kernels chose; read on logging steps only)."""
        self.boundaries += 1
        iv = self._interval
        iv["steps"] += 1
        iv["samples"] += window.samples
        iv["items"] += window.items
        if self.bar is not None:
            self.bar.update(1)
        if step == 1 or step % self.log_every == 0 or step == self.total:
            self._log(step, epoch, lr, grad_norm, skipped)
        self._stepped_at = time.perf_counter()

    def _log(self, step, epoch, lr, grad_norm, skipped=None):
        loss = self.reduce_loss(self._loss).item() / self._interval["steps"]  # the sync point, once per log
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        iv = self._interval
        row = {"step": step, "epoch": epoch, "loss": loss, "lr": float(lr),  # a device tensor under compile.optimizer
               "steps_averaged": iv["steps"],  # the steps behind the loss and rates (fewer after a resume)
               "step_time_s": dt / iv["steps"], "samples_per_s": iv["samples"] / dt,
               f"{self.items}_per_s": iv["items"] / dt, "skipped_steps": self.boundaries - self.optimizer_steps if skipped is None else int(skipped),
               "peak_mem_mb": round(peak_memory_mb(self.device), 1),
               "elapsed_s": now - self._t_start}
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        if self.resumed_from is not None:
            row["resumed_from"], self.resumed_from = self.resumed_from, None
        if self._memory:
            row["peak_mem_measures"], self._memory = self._memory, None
            row["mem_at_start_mb"] = self._mem_at_start
            row["started_at"] = self._started_at
            row.update(self.about)
        row.update(self._extra(dt))
        row.update(self.objective_metrics())
        row.update(self.compiled())
        self.write(row)
        self._loss, self._t0 = None, time.perf_counter()
        self._interval = {"steps": 0, "samples": 0, "items": 0}
        text = f"loss {loss:.4f}  {row[self.items + '_per_s']:,.0f} {UNITS.get(self.items, self.items)}/s  mem {row['peak_mem_mb']:,.0f} MB"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        elif self.enabled:
            log.info("step %d/%d  %s  lr %.3g", step, self.total, text, lr)

    def _extra(self, dt: float) -> dict:
        """Data waiting, FLOPs utilisation and memory: host-side reads only (no device sync)."""
        row = {"host_peak_rss_mb": round(host_peak_rss_mb(), 1)}
        wait = getattr(self._data, "wait_s", None)
        if wait is not None:
            row["data_wait_share"] = min(1.0, (wait - self._wait0) / dt)
            self._wait0 = wait
        if self.flops_per_sample:
            achieved = self._interval["samples"] * self.flops_per_sample / dt
            row["tflops"] = achieved / 1e12
            if self.peak_flops:
                row["mfu"] = achieved / self.peak_flops
        used = nvml_used_mb(self.device)
        if used is not None:
            row["device_mem_used_mb"] = round(used, 1)
        return row

    def eval(self, step: int, loss: float, seconds: float | None = None) -> None:
        """An evaluation's row, with ``eval_s``: its seconds (default: since the last optimizer
        step, which the loop's evaluation follows). The next interval's throughput leaves them out."""
        if seconds is None:
            seconds = time.perf_counter() - self._stepped_at
        self._t0 += seconds  # samples_per_s measures training steps, not the evaluations between them
        timing = {"eval_s": round(seconds, 4), **self.compiled()}
        metrics = getattr(loss, "metrics", None)  # a classifier's accuracy (looplib.evaluation.Scores)
        if metrics:
            self.write({"step": step, "eval_loss": float(loss), **metrics, **timing})
            if self.enabled:
                log.info("step %d: eval loss %.4f, %s", step, loss, ", ".join(
                    f"{k.removeprefix('eval_')} {v:.4f}" for k, v in metrics.items()))
            return
        ppl = math.exp(loss) if loss < 50 else float("inf")
        self.write({"step": step, "eval_loss": loss, "eval_perplexity": ppl, **timing})
        if self.enabled:  # through logging, so train.log has it too; above the bar on a terminal
            log.info("step %d: eval loss %.4f, perplexity %.2f", step, loss, ppl)

    def write(self, row: dict) -> None:
        self.last_row.update(row)
        self.jsonl.log(row)
        self.logger.log(row)

    def finish(self, status: str = "finished", artefacts: dict[str, str] | None = None) -> None:
        """End the trackers' run: ``finished``/``preempted``/``failed``, with the artefacts' paths."""
        if not self._finished:
            self._finished = True
            self.logger.finish(status, artefacts or {})

    def close(self) -> None:
        """Close the bar and metrics.jsonl; trackers not finished yet end as ``failed``."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._redirect.close()
        self.jsonl.finish("finished", {})
        self.finish("failed")
