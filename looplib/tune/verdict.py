"""What a search's runs say: each candidate's row, its predicted time to finish the job (from its
runs, ``objective``), its ratio to the reference with an interval and a verdict (``stats``), the
leader so far, and the choice once the finals ran.

``Verdicts`` is the half of ``search.Search`` that reads the rows and measures nothing: the
predicted job time, where it goes, after how many steps a candidate pays for its one-off costs,
the candidates within the memory limit, the leader, and the decision. "Faster beyond the noise"
is said only of a candidate whose interval against the reference excludes 1, and only after the
finals measured it again beside the reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import stats
from .measure import Outcome
from .objective import breakdown, predict
from .space import Candidate

MB = 2**20
GENERATION = ("precision", "engine")  # the dimensions that change how the end-of-run sample generates


@dataclass
class Row:
    candidate: Candidate
    overrides: list[str]
    status: str = "planned"          # measured | pruned | oom | error | diverged | skipped | interrupted
    reason: str = ""
    planned_mem_mb: float | None = None
    outcome: Outcome | None = None   # its first run (status, memory, loss)
    runs: list[Outcome] = field(default_factory=list)   # every timed run
    loss_delta: float | None = None
    stage: str = ""
    primed: Outcome | None = None    # the untimed run that filled the compile cache
    set_aside: list[Outcome] = field(default_factory=list)   # noisy runs measured again (not counted)
    noisy: bool = False              # a run and its repeat were both noisy (both count)
    vs_reference: stats.Ratio | None = None
    verdict: str = ""

    @property
    def measured(self) -> bool:
        return self.status == "measured" and bool(self.runs)

    @property
    def speed(self) -> float:
        return self.outcome.samples_per_s if self.measured and self.outcome else 0.0


class Verdicts:
    """The reading of a search's rows (``search.Search`` holds them, and the settings)."""

    def sample_of(self, row: Row) -> float | None:
        """The sample's seconds for ``row``'s candidate: measured in its own runs, or in a run of a
        candidate that generates the same way (same precision and engine); None: not measured yet."""
        if not self.job_plan.sample_tokens:
            return 0.0
        same = [r for r in self.rows if all(r.candidate.get(d) == row.candidate.get(d) for d in GENERATION)]
        seconds = [o.timing.sample_s for r in same for o in r.runs if o.timing and o.timing.sample_s is not None]
        return sum(seconds) / len(seconds) if seconds else None

    def times(self, row: Row) -> list[float]:
        """The job's predicted seconds, one per timed run of ``row``."""
        sample = self.sample_of(row)
        return [predict(o.timing, self.job_plan, sample) for o in row.runs if o.timing]

    def time(self, row: Row | None) -> float:
        """The job's predicted seconds (geometric mean over the runs; inf: not measured)."""
        t = self.times(row) if row is not None and row.measured else []
        return stats.geometric_mean(t) if t else math.inf

    def time_of(self, c: Candidate) -> float:
        return self.time(self.row(c))

    def parts(self, row: Row) -> dict[str, float]:
        """The predicted job time in parts (the mean over the runs)."""
        sample = self.sample_of(row)
        each = [breakdown(o.timing, self.job_plan, sample) for o in row.runs if o.timing]
        return {k: sum(p[k] for p in each) / len(each) for k in each[0]} if each else {}

    def step_s(self, row: Row) -> float | None:
        steps = [s for o in row.runs if o.timing for s in o.timing.step_s]
        return sum(steps) / len(steps) if steps else None

    def pays_off_after(self, row: Row) -> float | None:
        """The job length (steps) from which ``row`` finishes first against the timing reference:
        its extra one-off seconds over the steady seconds per step it saves. 0: at once (it costs
        no more); inf: never (its steps are not faster); None: not measured, or the reference."""
        ref = self.timing_reference()
        if ref is None or row is ref or not row.measured:
            return None
        t, t_ref = self.step_s(row), self.step_s(ref)
        steps = self.job_plan.max_steps
        fixed, fixed_ref = self.time(row) - steps * t, self.time(ref) - steps * t_ref
        if t >= t_ref:
            return math.inf
        return max(fixed - fixed_ref, 0.0) / (t_ref - t)

    def timing_reference(self) -> Row | None:
        """What every job time is a multiple of: the job as given, or the loss reference."""
        given = self.row(Candidate())
        return given if given is not None and given.measured else (
            self.reference if self.reference is not None and self.reference.measured else None)

    # ---------------------------------------------------------------- the leader and the choice
    def within_limit(self, row: Row) -> bool:
        """The measured peak within the memory limit (when one is given)."""
        peak = row.outcome.peak_mem_mb if row.outcome else None
        return (self.limit is None or not self.limit_measured or peak is None
                or peak * MB <= self.limit / (1 - self.tune.margin))

    def eligible(self) -> list[Row]:
        return [r for r in self.rows if r.measured and self.within_limit(r) and math.isfinite(self.time(r))]

    def leader(self) -> Candidate | None:
        """The measured candidate that finishes the job first by its runs so far (a simpler one
        within ``tune.speed_margin`` of it instead): the search's base, and the best so far."""
        ok = self.eligible()
        if not ok:
            return None
        top = min(self.time(r) for r in ok)
        ties = [r for r in ok if self.time(r) <= top * (1 + self.tune.speed_margin)]
        return min(ties, key=lambda r: (complexity(r.candidate), self.time(r))).candidate

    def finalists(self) -> list[Row]:
        """The ``tune.finalists`` candidates that finished the job first in their runs so far."""
        ref = self.timing_reference()
        if ref is None:
            return []
        return sorted([r for r in self.eligible() if r is not ref], key=self.time)[:self.tune.finalists]

    def judge(self) -> None:
        """Each measured row's job time as a multiple of the reference's, with its interval and verdict."""
        ref = self.timing_reference()
        if ref is None:
            return
        ref_times = self.times(ref)
        for row in self.rows:
            if row.measured and row is not ref:
                row.vs_reference = stats.ratio(self.times(row), ref_times)
                row.verdict = row.vs_reference.verdict(self.tune.resolution)
            elif row is ref:
                row.vs_reference, row.verdict = None, "reference"

    def decide(self) -> None:
        """The choice: the fastest of the candidates called faster than the reference, or a simpler
        one the same within noise as it; none faster: the reference (the job as given)."""
        self.judge()
        ref = self.timing_reference()
        eligible = self.eligible()
        if ref is None or ref not in eligible:
            self.choice = None if not eligible else min(eligible, key=self.time)
            self.why = ("the job as given did not run, or not within the memory limit: the candidate that finished "
                        "first among those that did" if eligible else "")
            return
        faster = [r for r in eligible if r.verdict == stats.FASTER]
        self.too_noisy = [r.candidate.label() for r in eligible if r.verdict == stats.NOISY
                          and r.vs_reference.ratio < 1 and r in self.finalists_measured()]
        judged = [r for r in eligible if r is not ref and r.vs_reference is not None and r.vs_reference.low is not None]
        if not judged:  # nothing measured again beside the reference: no interval, so no claim about noise
            self.choice = ref
            self.why = ("no other candidate ran within the limits: the job as given stays"
                        if all(r is ref for r in eligible) else
                        "no candidate was measured again beside the reference (no finals ran: tune.finalists=0, "
                        "or the budget ran out), so none can be called faster: the job as given stays")
            return
        if not faster:
            self.choice = ref
            self.why = ("no candidate finishes this job faster than the reference beyond the noise" +
                        ("; the machine was too noisy to decide for " + ", ".join(self.too_noisy)
                         if self.too_noisy else ""))
            return
        best = min(faster, key=self.time)
        for simpler in sorted(faster, key=lambda r: (complexity(r.candidate), self.time(r))):
            if complexity(simpler.candidate) >= complexity(best.candidate):
                break
            if stats.ratio(self.times(best), self.times(simpler)).verdict(self.tune.resolution) != stats.FASTER:
                self.why = (f"faster than the reference; {best.candidate.label()} is not faster than it "
                            "beyond the noise, and changes more")
                self.choice = simpler
                return
        self.choice, self.why = best, "faster than the reference beyond the noise, and the fastest such"

    def finalists_measured(self) -> list[Row]:
        return [r for r in self.rows if len(r.runs) > 1]

    def best(self) -> Candidate | None:
        """The decided choice, or (before the decision, or after a stop) the leader so far."""
        return self.choice.candidate if self.choice is not None else self.leader()


def complexity(c: Candidate) -> int:
    """How many things a candidate changes in the job."""
    return len(c.choice) + bool(c.micro_batch)
