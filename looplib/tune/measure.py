"""Measure one candidate: real steps of the real job, in a fresh process running the command line.

A fresh ``python -m looplib.train`` per candidate: the same assembly as any training run, its
own peak memory (CUDA's allocator peak, or the process's resident memory), and a crash, an
out-of-memory error or a hang that ends with the candidate alone (a time limit kills its
process group). It runs ``(repeats + 1) x steps`` optimizer steps, logging every ``steps``: the
first interval is the warm-up (compilation, allocator, caches: reported as ``compile_s`` and not
timed), each later row one timed repeat of whole steps (data, forward, backward, optimizer).

Under torchrun every rank of the tuner starts its own child with the rank's identity and a
fresh rendezvous port chosen by rank 0, and the ranks agree on the outcome (the worst status).
"""
from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EXIT_NUMERIC

SEVERITY = ["measured", "diverged", "oom", "error"]   # the ranks agree on the worst


@dataclass
class Outcome:
    status: str                       # measured | oom | error | diverged
    reason: str = ""
    samples_per_s: float | None = None
    spread: float | None = None       # (max - min) / median of the timed repeats
    tokens_per_s: float | None = None
    peak_mem_mb: float | None = None
    compile_s: float | None = None
    loss: float | None = None         # mean loss of the last timed repeat (the numerics check)
    wall_s: float = 0.0
    repeats: list[float] = field(default_factory=list)


def measure(run_dir: Path, job: list[str], overrides: list[str], steps: int, repeats: int, timeout_s: float,
            world=None) -> Outcome:
    """Run the candidate into ``run_dir`` and read what it measured. ``world``: the tuner's
    process group under torchrun (None: one process)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    total = (repeats + 1) * steps
    argv = [sys.executable, "-m", "looplib.train", *job, *overrides, f"max_steps={total}", f"log_every={steps}",
            "checkpoint.enabled=false", "eval_every=0", "eval_samples=0", "sample_tokens=0", "progress=lines",
            f"hydra.run.dir={run_dir}" if world is None else f"hydra.run.dir=${{looplib.rank0_dir:{run_dir}}}"]
    env = {**os.environ, "LOOPLIB_PLOT": "0", "LOOPLIB_EXIT_FILE": ""}
    if world is not None:
        env.update(world.child_env())
    t0 = time.perf_counter()
    status, reason = run_child(argv, env, timeout_s, run_dir)
    outcome = read(run_dir, steps, status, reason) if status == "measured" else Outcome(status, reason)
    outcome.wall_s = time.perf_counter() - t0
    if world is not None:
        outcome = world.agree(outcome)
    return outcome


def run_child(argv: list[str], env: dict, timeout_s: float, run_dir: Path) -> tuple[str, str]:
    log = run_dir.with_name(run_dir.name + ".log")
    with open(log, "w") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return "error", f"timed out after {timeout_s:.0f} s (tune.timeout_s)"
        except BaseException:  # Ctrl-C: the candidate goes too
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
    if code == 0:
        return "measured", ""
    text = log.read_text(errors="replace")
    if "OutOfMemoryError" in text or "out of memory" in text.lower():
        return "oom", "out of memory: " + last_line(text, ("OutOfMemoryError", "out of memory"))
    if code == EXIT_NUMERIC:  # looplib's stop after too many non-finite steps
        return "diverged", last_line(text, ("looplib: stopped",))
    return "error", f"exit {code}: " + last_line(text, ("looplib: error", "Error", "error"))


def last_line(text: str, marks: tuple[str, ...]) -> str:
    """The last line of the child's output holding one of ``marks`` (else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(m in line for m in marks):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def read(run_dir: Path, steps: int, status: str, reason: str) -> Outcome:
    """The timed repeats from metrics.jsonl: every row after the first interval."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
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
    compile_s = next((r["compile_s"] for r in rows if "compile_s" in r), None)
    return Outcome(status, reason, median, (max(speeds) - min(speeds)) / median if median else None,
                   statistics.median(r[items] for r in timed) if items == "tokens_per_s" else None,
                   round(peak, 1), compile_s, losses[-1], repeats=speeds)


class World:
    """The tuner under torchrun: one child per rank, a fresh port per candidate, one outcome."""

    def __init__(self):
        import torch.distributed as dist
        from ..engines.launch import init_process_group
        import torch
        init_process_group(torch.device("cpu"))  # gloo among the tuners; the children make their own group
        self.dist, self.rank, self.size = dist, dist.get_rank(), dist.get_world_size()

    def child_env(self) -> dict:
        from ..engines.launch import free_port
        port = [free_port() if self.rank == 0 else None]
        self.dist.broadcast_object_list(port, src=0)
        # the child's rank 0 hosts its own store on the fresh port (under torchrun the agent hosts
        # the tuners' store, and torch would otherwise wait for an agent's store on that port)
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.size), "MASTER_PORT": str(port[0]),
               "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0"), "TORCHELASTIC_USE_AGENT_STORE": "False"}
        return env

    def agree(self, outcome: Outcome) -> Outcome:
        everyone = self.gather(outcome)
        worst = max(everyone, key=lambda o: SEVERITY.index(o.status))
        return everyone[0] if worst.status == "measured" else worst

    def gather(self, obj) -> list:
        everyone = [None] * self.size
        self.dist.all_gather_object(everyone, obj)
        return everyone

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]
