"""The objective: the seconds to finish this job, predicted from one measured run of a candidate.

A candidate's run is the job itself, shortened: its startup, its compile and warm-up, a few
timed intervals of whole steps, two of its evaluations (the first pays for whatever the first
evaluation pays for: an eval-mode compile), one checkpoint save, its export and exit, and (in
the runs that measure it) its end-of-run sample. The job's time is that run's wall time plus
what the job does more of:

    job = run wall time + (max_steps - steps run) x step time
          + (evaluations - 2) x a later evaluation + (saves - 1) x a save
          + the sample (where this run did not generate it)

Step time is the mean of the timed intervals (the time to finish is a sum of steps, so the
mean, not the median), each less the seconds a recompile took inside it: a recompile is a
one-off cost, already in the run's wall time. When recompiles recur (in two or more timed
intervals) they are part of the step time and stay in it.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class JobPlan:
    """What the job does besides its steps, from its settings."""
    max_steps: int
    eval_every: int = 0
    eval_samples: int | None = 0  # None: the whole held-out split
    checkpoint: bool = False
    checkpoint_every: int = 0
    sample_tokens: int = 0

    @classmethod
    def of(cls, settings) -> "JobPlan":
        return cls(settings.max_steps, settings.eval_every, settings.eval_samples, settings.checkpoint.enabled,
                   settings.checkpoint.every_steps, settings.sample_tokens)

    @staticmethod
    def count(every: int, steps: int) -> int:
        """Events every ``every`` steps (0: none), and one at the end unless the last step had one."""
        return (steps // every if every else 0) + (0 if every and steps % every == 0 else 1)

    def evaluations(self) -> int:
        return self.count(self.eval_every, self.max_steps) if self.eval_samples != 0 else 0

    def saves(self) -> int:
        return self.count(self.checkpoint_every, self.max_steps) if self.checkpoint else 0

    def measurement(self, steps: int, repeats: int, sample: bool) -> list[str]:
        """The overrides of a measuring run: warm-up and ``repeats`` timed intervals of ``steps``
        steps; two evaluations (after the warm-up's last timed interval but one, and at the end)
        when the job evaluates; the final checkpoint when it saves; its sample when ``sample``."""
        total = (repeats + 1) * steps
        out = [f"max_steps={total}", f"log_every={steps}", "progress=lines", "resume=null"]
        out += ([f"eval_every={total - steps}", f"eval_samples={'null' if self.eval_samples is None else self.eval_samples}"] if self.evaluations()
                else ["eval_every=0", "eval_samples=0"])
        out += (["checkpoint.enabled=true", "checkpoint.every_steps=0", "checkpoint.keep=1"] if self.saves()
                else ["checkpoint.enabled=false"])
        return out + [f"sample_tokens={self.sample_tokens if sample else 0}"]

    def describe(self) -> str:
        parts = [f"{self.max_steps} steps"]
        if self.evaluations():
            parts.append(f"{self.evaluations()} evaluation(s) of " + (f"up to {self.eval_samples} held-out samples"
                                                                     if self.eval_samples else "every held-out sample"))
        if self.saves():
            parts.append(f"{self.saves()} checkpoint save(s)")
        if self.sample_tokens:
            parts.append(f"a sample of {self.sample_tokens} tokens")
        return ", ".join(parts)


@dataclass
class Run:
    """What one measuring run of a candidate took, read from its metrics.jsonl and its wall clock."""
    total_s: float                   # the process, from its start to its exit
    startup_s: float                 # from the start to the first step (imports, data, model)
    steps: int                       # steps it ran
    warmup_steps: int
    warmup_s: float                  # the warm-up's steps (the first compile among them)
    step_s: list[float]              # seconds per step of each timed interval, recompiles left out
    evals_s: list[float] = field(default_factory=list)
    save_s: float | None = None      # one checkpoint save
    sample_s: float | None = None    # None: this run generated no sample
    compile_s: float | None = None   # every compile of the run (recompiles and eval mode too)
    compiles: int | None = None
    recompiled_at: list[int] = field(default_factory=list)  # steps after the warm-up where a recompile happened
    load: float | None = None        # the machine's 1-minute load average as the run started

    @property
    def step_mean(self) -> float:
        return statistics.fmean(self.step_s)

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def read_run(metrics: Path, warmup_steps: int, spawned: float, ended: float, load: float | None) -> Run | None:
    """A run's timings from its metrics.jsonl (``spawned``/``ended``: wall clock around the process)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step_time_s" in r]
    timed = [r for r in steps if r["step"] > warmup_steps]
    if not timed or "started_at" not in rows[0]:
        return None
    compiled, previous, intervals, recompiled = 0.0, None, [], []
    for r in rows:  # compile seconds so far ride on every row: the difference is what was compiled in between
        now = r.get("compile_s", compiled)
        if r in timed and previous is not None:
            n = r["step"] - previous["step"]
            intervals.append((r["step_time_s"], n, now - compiled))
            if now - compiled > 0:
                recompiled.append(r["step"])
        if "loss" in r or "eval_loss" in r:
            compiled = now
        if r in steps:
            previous = r
    recur = len(recompiled) >= 2
    step_s = [max(per_step - (0.0 if recur else extra / n), 1e-9) for per_step, n, extra in intervals]
    warm = next((r for r in steps if r["step"] == warmup_steps), steps[0])
    closing = [r for r in rows if "checkpoint_s" in r]
    saved = closing[-1]["checkpoint_s"] / max(closing[-1].get("checkpoints", 1), 1) if closing else None
    last_compile = next((r for r in reversed(rows) if "compile_s" in r), {})
    sample = next((r["sample_s"] for r in rows if "sample_s" in r), None)
    return Run(total_s=ended - spawned, startup_s=max(rows[0]["started_at"] - spawned, 0.0), steps=steps[-1]["step"],
               warmup_steps=warm["step"], warmup_s=warm["elapsed_s"], step_s=step_s,
               evals_s=[r["eval_s"] for r in rows if "eval_s" in r], save_s=saved, sample_s=sample,
               compile_s=last_compile.get("compile_s"), compiles=last_compile.get("compiles"),
               recompiled_at=recompiled, load=load)


def predict(run: Run, plan: JobPlan, sample_s: float | None) -> float:
    """The job's seconds, from this run; ``sample_s``: the sample's seconds for this candidate
    (measured in this run, or in another run that generates as this candidate does)."""
    return sum(breakdown(run, plan, sample_s).values())


def breakdown(run: Run, plan: JobPlan, sample_s: float | None) -> dict[str, float]:
    """The predicted job time in parts: startup, compile and warm-up (beyond steady steps), steps,
    evaluations, checkpoint saves, sample, and the rest (export, exit, recompiles after the warm-up)."""
    t = run.step_mean
    total = run.total_s + (plan.max_steps - run.steps) * t
    evals = 0.0
    n = plan.evaluations()
    if n and run.evals_s:
        later = run.evals_s[-1]
        total += (n - len(run.evals_s)) * later
        evals = run.evals_s[0] + (n - 1) * later
    saves = 0.0
    if plan.saves() and run.save_s is not None:
        total += (plan.saves() - 1) * run.save_s
        saves = plan.saves() * run.save_s
    sample = (sample_s or 0.0) if plan.sample_tokens else 0.0
    total += sample - (run.sample_s or 0.0)
    parts = {"startup": run.startup_s, "warmup": max(run.warmup_s - run.warmup_steps * t, 0.0),
             "steps": plan.max_steps * t, "evaluations": evals, "checkpoints": saves, "sample": sample}
    parts["rest"] = total - sum(parts.values())
    return parts
