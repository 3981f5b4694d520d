"""Measure one candidate: the real job, shortened, in a fresh process running its command line.

A fresh ``python -m looplib.train`` per run: the same assembly as any training run, its own
peak memory (CUDA's allocator peak, or the process's resident memory), and a crash, an
out-of-memory error or a hang that ends with the candidate alone (a time limit kills its
process group). The run's overrides (``objective.JobPlan.measurement``) make it the job in
small: warm-up and timed intervals of whole steps (data, forward, backward, optimizer), two of
the job's evaluations, its checkpoint save, its export and exit; its wall time and the
seconds each part took (metrics.jsonl) are what ``objective`` predicts the job's time from.

A stop asked for (a signal to the tuner: ``stop()`` returns its number) kills the running
candidate's whole process group at once and raises ``Interrupted``.

Under torchrun every rank of the tuner starts its own child with the rank's identity and a
fresh rendezvous port chosen by rank 0, and the ranks agree on the outcome (the worst status:
``world.World``).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import EXIT_NUMERIC, Interrupted
from .objective import Run, read_run

# a test hook: extra environment for chosen runs, {"CANDIDATE LABEL" or "LABEL#K" (its K-th timed run): {VAR: VALUE}}
TEST_ENV = "LOOPLIB_TUNE_TEST_ENV"


@dataclass
class Outcome:
    status: str                       # measured | oom | error | diverged
    reason: str = ""
    samples_per_s: float | None = None
    spread: float | None = None       # (max - min) / median of the timed intervals
    tokens_per_s: float | None = None
    peak_mem_mb: float | None = None
    compile_s: float | None = None
    loss: float | None = None         # mean loss of the last timed interval (the numerics check)
    wall_s: float = 0.0
    repeats: list[float] = field(default_factory=list)
    timing: Run | None = None         # what each part of the run took (objective.Run)
    dropout: float = 0.0              # the model's dropout (the first row): its masks change with the micro-batch


def measure(run_dir: Path, job: list[str], overrides: list[str], measurement: list[str], warmup_steps: int,
            timeout_s: float, world=None, stop: Callable[[], int | None] = lambda: None,
            env: dict | None = None) -> Outcome:
    """Run the candidate into ``run_dir`` and read what it measured. ``measurement``: the
    overrides that make the run the job in small; ``world``: the tuner's process group under
    torchrun (None: one process); ``env``: extra environment (the test hook)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "looplib.train", *job, *overrides, *measurement,
            f"hydra.run.dir={run_dir}" if world is None else f"hydra.run.dir=${{looplib.rank0_dir:{run_dir}}}"]
    full_env = {**os.environ, "LOOPLIB_EXIT_FILE": "", **(env or {})}
    if world is not None:
        full_env.update(world.child_env())
    load = os.getloadavg()[0]
    spawned, t0 = time.time(), time.perf_counter()
    status, reason = run_child(argv, full_env, timeout_s, run_dir, stop)
    ended = time.time()
    outcome = (read(run_dir, warmup_steps, spawned, ended, load) if status == "measured"
               else Outcome(status, reason))
    outcome.wall_s = time.perf_counter() - t0
    for heavy in ("checkpoints", "model.safetensors", "hf", "adapter"):  # timed: its weights are not needed
        path = run_dir / heavy
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if world is not None:
        outcome = world.agree(outcome)
    return outcome


def run_child(argv: list[str], env: dict, timeout_s: float, run_dir: Path,
              stop: Callable[[], int | None] = lambda: None) -> tuple[str, str]:
    log = run_dir.with_name(run_dir.name + ".log")
    with open(log, "w") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started = time.perf_counter()
        try:
            while True:
                try:
                    code = child.wait(timeout=0.05)
                    break
                except subprocess.TimeoutExpired:
                    signum = stop()
                    if signum is not None:
                        raise Interrupted(signum) from None
                    if time.perf_counter() - started > timeout_s:
                        kill(child)
                        return "error", f"timed out after {timeout_s:.0f} s (tune.timeout_s)"
        except BaseException:  # a stop, a second Ctrl-C: the candidate and everything it started go too
            kill(child)
            raise
    if code == 0:
        return "measured", ""
    text = log.read_text(errors="replace")
    if "OutOfMemoryError" in text or "out of memory" in text.lower():
        return "oom", "out of memory: " + last_line(text, ("OutOfMemoryError", "out of memory"))
    if code == EXIT_NUMERIC:  # looplib's stop after too many non-finite steps
        return "diverged", last_line(text, ("looplib: stopped",))
    return "error", f"exit {code}: " + last_line(text, ("looplib: error", "Error", "error"))


def kill(child: subprocess.Popen) -> None:
    """The child's whole process group (its loader workers, compile workers), at once."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def last_line(text: str, marks: tuple[str, ...]) -> str:
    """The last line of the child's output holding one of ``marks`` (else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(m in line for m in marks):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def read(run_dir: Path, steps: int, spawned: float, ended: float, load: float | None) -> Outcome:
    """The timed intervals (every row after the warm-up's ``steps``) and the run's timings."""
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    timed = [r for r in rows if "loss" in r and r["step"] > steps]
    if not timed:
        return Outcome("error", "the run logged no timed step")
    losses = [r["loss"] for r in timed]
    if not all(math.isfinite(x) for x in losses):
        return Outcome("diverged", f"the loss is not finite ({losses[-1]})")
    speeds = [r["samples_per_s"] for r in timed]
    median = statistics.median(speeds)
    items = next((k for k in timed[-1] if k.endswith("_per_s") and k not in ("samples_per_s",)), None)
    first = rows[0]
    peak = max(r.get("peak_mem_mb", 0.0) for r in rows)
    if first.get("peak_mem_measures", "").startswith("process resident"):  # the CPU: this job's rise in RSS
        peak -= first.get("mem_at_start_mb", 0.0)
    timing = read_run(metrics, steps, spawned, ended, load)
    if timing is None:
        return Outcome("error", "the run's metrics.jsonl lacks its timings (started_at)")
    return Outcome("measured", "", median, (max(speeds) - min(speeds)) / median if median else None,
                   statistics.median(r[items] for r in timed) if items == "tokens_per_s" else None,
                   round(peak, 1), timing.compile_s, losses[-1], repeats=speeds, timing=timing,
                   dropout=first.get("dropout", 0.0))


def test_env(label: str, run: int) -> dict:
    """The test hook's extra environment for the ``run``-th timed run (1-based) of ``label``."""
    given = os.environ.get(TEST_ENV)
    if not given:
        return {}
    table = json.loads(given)
    return {**table.get(label, {}), **table.get(f"{label}#{run}", {})}
