"""What every runner of scripts/bench_peers.py measures the same way: step times (the device
synchronised at each step's end), the allocator's peak, and the one JSON line it prints last."""
from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import torch


class StepClock:
    """Wall-clock time between the ends of consecutive optimizer steps (the device synchronised
    first), so a step's time holds everything it waits for: data, forward, backward, update."""

    def __init__(self, device: torch.device):
        self.device, self.ends, self.start = device, [], None

    def begin(self) -> None:
        self.sync()
        self.start = time.perf_counter()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_end(self) -> None:
        self.sync()
        self.ends.append(time.perf_counter())

    def step_times(self) -> list[float]:
        marks = [self.start] + self.ends
        return [b - a for a, b in zip(marks, marks[1:])]


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float:
    """The allocator's peak on a GPU (torch.cuda.max_memory_allocated); the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summary(spec: dict, times: list[float], losses: list[float], device: torch.device, **extra) -> dict:
    """The row's figures: tokens/s of the median step after ``spec['warmup']`` steps (every input
    token of the global batch counts, masked or not), the peak, the last and first step's losses."""
    timed = times[spec["warmup"]:]
    if not timed:
        raise RuntimeError(f"only {len(times)} steps ran, none after the {spec['warmup']} warm-up steps")
    median = statistics.median(timed)
    tokens = spec["global_batch"] * spec["seq_len"]
    return {"tokens_per_s": tokens / median, "median_step_s": median, "first_step_s": times[0],
            "timed_steps": len(timed), "peak_mem_mb": round(peak_mb(device), 1),
            "loss": losses[-1] if losses else None, "first_loss": losses[0] if losses else None, **extra}


def emit(result: dict) -> None:
    """The runner's answer: one JSON line, the last line of stdout."""
    sys.stdout.flush()
    print("PEERS_RESULT " + json.dumps(result), flush=True)


def device_for(spec: dict) -> torch.device:
    return torch.device(spec["device"])


def versions(*names: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
