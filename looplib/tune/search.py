"""The search: plan every candidate, measure the survivors in the order likely fastest first.

1. The job as given: the baseline every row is a multiple of, and the loss reference.
2. Micro-batch x accumulation (the global batch never changes) with and without activation
   checkpointing: largest micro-batch first; an out-of-memory error moves to the next smaller;
   a micro-batch slower than a larger one that fitted ends that branch (the smaller ones are
   ``skipped``: dominated); checkpointing is measured at the best micro-batch and at the larger
   ones it makes fit.
3. From the fastest so far, each remaining dimension one option at a time (compile modes, the
   chunked loss, optimizer kernels, engines; with ``tune.numerics=allow`` precisions and
   optimizers).
4. The options that each beat it, together (and, when they save memory, one micro-batch larger).

The planner prunes before anything runs; ``tune.budget_s`` skips what would start after it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .measure import Outcome, measure
from .space import Candidate, Space
from .settings import Tune, without

MB = 2**20


@dataclass
class Row:
    candidate: Candidate
    overrides: list[str]
    status: str = "pending"          # measured | pruned | oom | error | diverged | skipped
    reason: str = ""
    planned_mem_mb: float | None = None
    outcome: Outcome | None = None
    loss_delta: float | None = None
    stage: str = ""

    @property
    def speed(self) -> float:
        return self.outcome.samples_per_s if self.status == "measured" and self.outcome else 0.0


@dataclass
class Search:
    space: Space
    job: list[str]                    # the job's overrides, without the measurement's keys
    tune: Tune
    run_dir: Path
    plan: Callable[[Candidate], int | None]   # planned bytes per rank (None: the planner cannot say)
    limit: int | None                 # bytes a candidate may plan (after the margin); None: no limit
    world: object = None              # measure.World under torchrun
    progress: Callable[[Row, "Search"], None] = lambda row, search: None
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    reference: Row | None = None

    # ---------------------------------------------------------------- one candidate
    def row(self, c: Candidate) -> Row | None:
        return next((r for r in self.rows if r.candidate == c), None)

    def try_(self, c: Candidate, stage: str) -> Row:
        """Plan, then measure ``c`` (once: a candidate met again returns its row)."""
        seen = self.row(c)
        if seen is not None:
            return seen
        row = Row(c, self.space.overrides(c), stage=stage)
        self.rows.append(row)
        planned = self.plan(c)
        row.planned_mem_mb = None if planned is None else round(planned / MB, 1)
        if planned is not None and self.limit is not None and planned > self.limit:
            row.status = "pruned"
            row.reason = (f"planned {planned / MB:,.0f} MB > {self.limit / MB:,.0f} MB usable "
                          f"({1 - self.tune.margin:.0%} of the memory limit)")
        elif self.elapsed() + self.expected() > self.tune.budget_s:
            row.status, row.reason = "skipped", f"over the budget (tune.budget_s={self.tune.budget_s:g})"
        else:
            where = self.run_dir / "candidates" / f"{len(self.rows) - 1:03d}"
            row.outcome = measure(where, without(self.job, row.overrides), row.overrides, self.tune.steps, self.tune.repeats,
                                  self.tune.timeout_s, self.world)
            row.status, row.reason = row.outcome.status, row.outcome.reason
            self.check_numerics(row)
        self.progress(row, self)
        return row

    def skip(self, c: Candidate, why: str, stage: str) -> None:
        if self.row(c) is None:
            self.rows.append(Row(c, self.space.overrides(c), "skipped", why, stage=stage))

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def expected(self) -> float:
        """What one more candidate will take: the slowest measured so far (0 before any)."""
        return max((r.outcome.wall_s for r in self.rows if r.outcome), default=0.0)

    def check_numerics(self, row: Row) -> None:
        """Compare the candidate's loss with the reference's on the same batches."""
        ref = self.reference
        if row.status != "measured" or ref is None or ref is row or ref.status != "measured":
            return
        delta = row.outcome.loss - ref.outcome.loss
        row.loss_delta = delta
        scale = max(1.0, abs(ref.outcome.loss))
        if not row.candidate.changes_numerics and abs(delta) > self.tune.tolerance * scale:
            row.status = "error"
            row.reason = (f"the same math as the reference, yet its loss differs by {delta:+.3g} "
                          f"(tune.tolerance={self.tune.tolerance:g}): a bug, please report it")
        elif row.candidate.changes_numerics and abs(delta) > self.tune.loss_tolerance * scale:
            row.status = "diverged"
            row.reason = f"loss {row.outcome.loss:.4f} vs the reference's {ref.outcome.loss:.4f} (tune.loss_tolerance)"

    # ---------------------------------------------------------------- the stages
    def run(self) -> list[Row]:
        self.reference = self.try_(Candidate(), "the job as given")
        self.batch_and_checkpointing()
        base = self.best() or Candidate()
        improved = {}
        for dim in [d for d in self.space.options if d not in ("batch", "checkpointing")]:
            winner = base_speed = self.speed_of(base)
            for option in self.space.options[dim][1:]:
                row = self.try_(base.with_(**{dim: option}), f"vary {dim}")
                if row.speed > max(winner, base_speed * (1 + self.tune.speed_margin)):
                    winner, improved[dim] = row.speed, option
        if len(improved) > 1:
            combined = self.try_(base.with_(**improved), "the winners together")
            self.one_larger(combined)
        return self.rows

    def batch_and_checkpointing(self) -> None:
        micro = [int(b) for b in self.space.options.get("batch", [])]
        ckpt = self.space.options.get("checkpointing", [None])
        fitted: dict[str | None, int] = {}
        for option in ckpt:
            option = None if option in (None, "none") else option
            best_in_branch, stop = None, None
            for b in micro:
                same = (b, self.space.per_rank // b) == self.space.job_batch  # the job's own micro-batch
                c = Candidate().with_(batch=(0, 0) if same else (b, self.space.per_rank // b), checkpointing=option)
                if stop:
                    self.skip(c, stop, "micro-batch")
                    continue
                if option is not None and fitted.get(None) and b < fitted[None]:
                    stop = (f"dominated: without checkpointing micro-batch {fitted[None]} fits, and "
                            "recomputing costs time")
                    self.skip(c, stop, "micro-batch")
                    continue
                row = self.try_(c, "micro-batch x checkpointing")
                if row.status != "measured":
                    continue
                fitted.setdefault(option, b)
                if best_in_branch is not None and row.speed < best_in_branch.speed:
                    stop = f"dominated: slower than micro-batch {best_in_branch.candidate.micro_batch or 'as given'}"
                elif option is not None:
                    stop = "dominated: checkpointing is measured at its largest micro-batch only"
                best_in_branch = row if best_in_branch is None or row.speed >= best_in_branch.speed else best_in_branch

    def one_larger(self, row: Row) -> None:
        """A combination that saves memory may fit the next larger micro-batch: try it once."""
        c, micro = row.candidate, [int(b) for b in self.space.options.get("batch", [])]
        larger = [b for b in micro if b > (c.micro_batch or self.space.job_batch[0])]
        if row.status == "measured" and larger:
            b = min(larger)
            self.try_(c.with_(batch=(b, self.space.per_rank // b)), "the winners together, larger")

    def speed_of(self, c: Candidate) -> float:
        row = self.row(c)
        return row.speed if row else 0.0

    def within_limit(self, row: Row) -> bool:
        """The measured peak within the memory limit (when one is given)."""
        peak = row.outcome.peak_mem_mb if row.outcome else None
        return self.limit is None or peak is None or peak * MB <= self.limit / (1 - self.tune.margin)

    def best(self) -> Candidate | None:
        """The fastest measured candidate within the memory limit; where a simpler one (fewer
        changes to the job) is as fast within the noise (the two rows' spreads, at least
        ``tune.speed_margin``), the simpler one: a change is kept only for a real speed-up."""
        ok = [r for r in self.rows if r.status == "measured" and math.isfinite(r.speed) and self.within_limit(r)]
        if not ok:
            return None
        top = max(ok, key=lambda r: r.speed)
        spread = lambda r: r.outcome.spread or 0.0  # noqa: E731
        ties = [r for r in ok if r.speed * (1 + max(self.tune.speed_margin, (spread(r) + spread(top)) / 2)) >= top.speed]
        return min(ties, key=lambda r: (complexity(r.candidate), -r.speed)).candidate


def complexity(c: Candidate) -> int:
    """How many things a candidate changes in the job."""
    return len(c.choice) + bool(c.micro_batch)
