"""The search: plan every candidate, measure the survivors in the order likely fastest first,
measure the leaders again beside the job as given, and decide.

0. Priming (untimed; ``tune.prime=false``: none): the job as given runs a step, so that the
   one-off costs of a first run (the token cache, the file cache) are paid before the first timed
   candidate; each candidate that compiles runs once untimed before its first timed run (the
   compile cache: the user's run after tune finds it warm, so the timed runs do too; the cold
   compile is reported).
1. The job as given: the reference every candidate's time is a multiple of, and the loss
   reference.
2. Micro-batch x accumulation (the global batch never changes) with and without activation
   checkpointing: largest micro-batch first; an out-of-memory error moves to the next smaller;
   a micro-batch slower than a larger one that fitted ends that branch (the smaller ones are
   ``skipped``: dominated); checkpointing is measured at the best micro-batch and at the larger
   ones it makes fit.
3. From the fastest so far (measured once more beside the reference first: one noisy run must
   not choose the base), each remaining dimension one option at a time (compile modes, the
   chunked loss, optimizer kernels, engines; with ``tune.numerics=allow`` precisions and
   optimizers).
4. The options that each beat it, together (and, when they save memory, one micro-batch larger).
5. The finals: the leaders (the ``tune.finalists`` candidates that finished the job first in their
   runs so far) and the reference are measured again, interleaved, for
   ``tune.rounds`` rounds, and more (up to ``tune.max_rounds``) while a leader could be faster
   but its interval still holds 1 and is too wide to say (``stats``).
6. The choice: among the candidates whose interval lies below 1 (``faster``) the one that finishes
   the job first, unless a simpler one (changing fewer things) is the same within noise; with
   none faster, the job as given.

"Faster" is always the predicted time to finish this job (``objective``): a compile that does
not pay for itself within the job's steps is slower. A run whose timed intervals spread more
than ``tune.max_spread`` is measured again at once. The planner prunes before anything runs;
``tune.budget_s`` skips what would start after it; a signal stops the search where it is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import Interrupted, signal_name
from . import stats
from .measure import Outcome, measure, test_env
from .objective import JobPlan
from .settings import Tune, key_of, without
from .space import Candidate, Space
from .verdict import MB, Row, Verdicts  # noqa: F401 - Row: what a search's readers take from here



@dataclass
class Search(Verdicts):
    space: Space
    job: list[str]                    # the job's overrides, without the measurement's keys
    tune: Tune
    run_dir: Path
    plan: Callable[[Candidate], int | None]   # planned bytes per rank (None: the planner cannot say)
    limit: int | None                 # bytes a candidate may plan (after the margin); None: no limit
    job_plan: JobPlan = field(default_factory=lambda: JobPlan(300))
    world: object = None              # world.World under torchrun
    limit_measured: bool = True       # the measured peak is held to the limit too (CUDA: allocated bytes,
                                      # comparable to the plan; the CPU's RSS also counts Python's own memory)
    progress: Callable[[Row, "Search"], None] = lambda row, search: None
    note: Callable[[str], None] = lambda text: None   # a line for the user (the priming runs)
    stop: Callable[[], int | None] = lambda: None   # a signal's number once one asked the search to stop
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    reference: Row | None = None      # the loss reference: the job as given, or the first same-math row that ran
    primes: list[dict] = field(default_factory=list)
    rounds: int = 0                   # rounds of the finals measured
    choice: Row | None = None         # set by decide()
    why: str = ""
    too_noisy: list[str] = field(default_factory=list)
    runs_started: int = 0
    cost: dict = field(default_factory=dict)   # what the search will cost against the job (said before it runs)

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
        elif self.over_budget():
            row.status, row.reason = "skipped", f"over the budget (tune.budget_s={self.tune.budget_s:g})"
        else:
            row.status = "running"
            if self.compiles(c) and self.tune.prime:
                self.prime(row)
            outcome = self.run_once(row)
            row.outcome = outcome
            row.status, row.reason = outcome.status, outcome.reason
            self.check_numerics(row)
        self.progress(row, self)
        return row

    def run_once(self, row: Row, measure_sample: bool | None = None) -> Outcome:
        """One timed run of ``row``'s candidate (kept in ``row.runs`` when it measured). A run whose
        timed intervals spread beyond ``tune.max_spread`` is noisy: it is measured again at once, and
        set aside when the new run is not noisy (both count when it is, and the row says so)."""
        if measure_sample is None:
            measure_sample = self.sample_of(row) is None
        outcome = self.measure(row, self.job_plan.measurement(self.tune.steps, self.tune.repeats, measure_sample),
                               env=test_env(row.candidate.label(), len(row.runs) + len(row.set_aside) + 1))
        if outcome.status != "measured":
            return outcome
        row.runs.append(outcome)
        if row.status in ("measured", "running") and self.noisy(outcome) and not self.over_budget():
            again = self.measure(row, self.job_plan.measurement(self.tune.steps, self.tune.repeats, measure_sample),
                                 env=test_env(row.candidate.label(), len(row.runs) + len(row.set_aside) + 1))
            if again.status == "measured":
                row.runs.append(again)
                if not self.noisy(again):
                    row.runs.remove(outcome)
                    row.set_aside.append(outcome)
                else:
                    row.noisy = True
        return outcome

    def noisy(self, outcome: Outcome) -> bool:
        return (outcome.spread or 0.0) > self.tune.max_spread

    def measure(self, row: Row, measurement: list[str], env: dict | None = None, warmup: int | None = None) -> Outcome:
        if self.stop() is not None:  # asked to stop between two runs: none is started
            raise Interrupted(self.stop())
        self.runs_started += 1
        where = self.run_dir / "candidates" / f"{self.runs_started - 1:03d}"
        return measure(where, without(self.job, row.overrides), row.overrides, measurement,
                       self.tune.steps if warmup is None else warmup, self.tune.timeout_s, self.world, self.stop, env)

    def prime(self, row: Row) -> None:
        """An untimed run of ``row``'s candidate that pays its one-off costs (the compile cache)."""
        self.note(f"{row.candidate.label()}: one untimed run first, to fill the compile cache")
        outcome = self.measure(row, self.job_plan.measurement(self.tune.steps, 1, False))  # its evaluations too
        row.primed = outcome
        self.primes.append({"candidate": row.candidate.label(), "status": outcome.status,
                            "wall_s": round(outcome.wall_s, 1), "compile_s": outcome.compile_s})

    def prime_caches(self) -> None:
        """Before the first timed run: the job as given (or, pruned, its smallest micro-batch) runs a
        step untimed, so that no candidate pays for the token and file caches."""
        c = Candidate()
        planned = self.plan(c)
        if planned is not None and self.limit is not None and planned > self.limit and self.space.micro_batches():
            c = Candidate().with_(batch=(1, self.space.per_rank))
        row = Row(c, self.space.overrides(c))
        self.note(f"{c.label()}: one untimed step first, to fill the token and file caches")
        outcome = self.measure(row, ["max_steps=1", "log_every=1", "eval_every=0", "eval_samples=0",
                                     "checkpoint.enabled=false", "sample_tokens=0", "progress=lines", "resume=null"],
                               warmup=0)
        self.primes.append({"candidate": c.label(), "status": outcome.status, "wall_s": round(outcome.wall_s, 1),
                            "what": "the token and file caches"})

    def runs_planned(self) -> tuple[int, int]:
        """(likely, at most) timed runs of the search: the micro-batches, checkpointing where it is
        measured, each other option once, the leader confirmed, the finals' rounds; at most every
        micro-batch with every checkpointing option, the winners together twice, every round."""
        options, tune = self.space.options, self.tune
        batch, ckpt = len(options.get("batch", [])) or 1, len(options.get("checkpointing", [])) or 1
        others = sum(len(v) - 1 for k, v in options.items() if k not in ("batch", "checkpointing"))
        confirm = 2 if others else 0
        finals = (tune.finalists + 1) if tune.finalists else 0
        likely = batch + ckpt - 1 + others + confirm + finals * tune.rounds
        most = batch * ckpt + others + confirm + 2 + finals * tune.max_rounds
        return likely, max(likely, most)

    def say_cost(self, given: Row) -> None:
        """What the search will cost against the job, once the job as given ran: its predicted time,
        a run's wall time, the runs to come (also in tune.json's ``cost``)."""
        likely, most = self.runs_planned()
        run_s = sum(o.wall_s for o in given.runs) / len(given.runs) if given.measured else None
        job_s = self.time(given) if given.measured else None
        self.cost.update(runs_likely=likely, runs_most=most, run_s=run_s and round(run_s, 2),
                         job_s=job_s and round(job_s, 2), job_s_start=job_s and round(job_s, 2),
                         budget_s=self.tune.budget_s)  # job_s becomes the final prediction; job_s_start stays
        if run_s is None:
            return
        search_s = min(likely * run_s, self.tune.budget_s)
        self.cost["search_s_likely"] = round(search_s, 1)
        self.note(f"the job as given is predicted to take {job_s:,.1f} s; a measuring run took {run_s:,.1f} s, so "
                  f"the search's ~{likely} runs (at most {most}) should take ~{search_s:,.0f} s, "
                  f"{search_s / job_s:,.1f}x the job itself (tune.budget_s={self.tune.budget_s:g} bounds it)")

    def compiles(self, c: Candidate) -> bool:
        option = c.get("compile")
        if option is not None:
            return option != "none"
        return any(key_of(o) == "compile" and not o.endswith("=none") for o in self.job)

    def skip(self, c: Candidate, why: str, stage: str) -> None:
        if self.row(c) is None:
            self.rows.append(Row(c, self.space.overrides(c), "skipped", why, stage=stage))

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def expected(self) -> float:
        """What one more run will take: the slowest timed run so far (0 before any)."""
        return max((o.wall_s for r in self.rows for o in r.runs), default=0.0)

    def over_budget(self) -> bool:
        over = self.elapsed() + self.expected() > self.tune.budget_s
        return self.world.broadcast(over) if self.world is not None else over  # the ranks run the same runs

    def check_numerics(self, row: Row) -> None:
        """Compare the candidate's loss with the reference's on the same batches."""
        ref = self.reference
        if row.status == "measured" and not row.candidate.changes_numerics and (ref is None or ref.status != "measured"):
            self.reference = row  # the job as given did not run (pruned, out of memory): the first same-math row
            return
        if row.status != "measured" or ref is None or ref is row or ref.status != "measured":
            return
        delta = row.outcome.loss - ref.outcome.loss
        row.loss_delta = delta
        scale = max(1.0, abs(ref.outcome.loss))
        # dropout draws other masks when the micro-batch (or compile's kernels) change: not the same math
        exact = not row.candidate.changes_numerics and not max(row.outcome.dropout, ref.outcome.dropout)
        if exact and abs(delta) > self.tune.tolerance * scale:
            row.status = "error"
            row.reason = (f"the same math as the reference, yet its loss differs by {delta:+.3g} "
                          f"(tune.tolerance={self.tune.tolerance:g}): a bug, please report it")
        elif not exact and abs(delta) > self.tune.loss_tolerance * scale:
            row.status = "diverged"
            row.reason = (f"loss {row.outcome.loss:.4f} vs the reference's {ref.outcome.loss:.4f} (tune.loss_tolerance"
                          + (f"; the model's dropout {max(row.outcome.dropout, ref.outcome.dropout):g} draws other "
                             "masks here)" if not row.candidate.changes_numerics else ")"))

    # ---------------------------------------------------------------- the stages
    def run(self) -> list[Row]:
        if self.tune.prime:
            self.prime_caches()
        given = self.try_(Candidate(), "the job as given")
        self.say_cost(given)
        self.batch_and_checkpointing()
        others = [d for d in self.space.options if d not in ("batch", "checkpointing")]
        base = (self.confirmed_leader() if others else self.leader()) or Candidate()
        improved = {}
        for dim in others:
            winner = base_time = self.time_of(base)
            for option in self.space.options[dim][1:]:
                row = self.try_(base.with_(**{dim: option}), f"vary {dim}")
                if self.time(row) < min(winner, base_time / (1 + self.tune.speed_margin)):
                    winner, improved[dim] = self.time(row), option
        if len(improved) > 1:
            combined = self.try_(base.with_(**improved), "the winners together")
            self.one_larger(combined)
        self.mark_memory()
        self.finals()
        self.decide()
        return self.rows

    def confirmed_leader(self) -> Candidate | None:
        """The leader, measured once more beside the reference before the other dimensions are
        varied from it: one noisy run must not choose the base of the rest of the search."""
        lead, ref = self.leader(), self.timing_reference()
        row = self.row(lead) if lead is not None else None
        if row is None or ref is None or row is ref or len(row.runs) > 1 or self.over_budget():
            return lead
        self.run_once(row, measure_sample=False)
        self.run_once(ref, measure_sample=False)
        self.judge()
        self.progress(row, self)
        return self.leader()

    def mark_memory(self) -> None:
        for row in self.rows:
            if row.measured and not self.within_limit(row):
                row.reason = (f"measured {row.outcome.peak_mem_mb:,.0f} MB, above the memory limit: not chosen "
                              "(the plan was under it)")

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
                if not row.measured:
                    continue
                fitted.setdefault(option, b)
                if best_in_branch is not None and self.time(row) > self.time(best_in_branch):
                    stop = f"dominated: slower than micro-batch {best_in_branch.candidate.micro_batch or 'as given'}"
                elif option is not None:
                    stop = "dominated: checkpointing is measured at its largest micro-batch only"
                if best_in_branch is None or self.time(row) <= self.time(best_in_branch):
                    best_in_branch = row

    def one_larger(self, row: Row) -> None:
        """A combination that saves memory may fit the next larger micro-batch: try it once."""
        c, micro = row.candidate, [int(b) for b in self.space.options.get("batch", [])]
        larger = [b for b in micro if b > (c.micro_batch or self.space.job_batch[0])]
        if row.measured and larger:
            b = min(larger)
            self.try_(c.with_(batch=(b, self.space.per_rank // b)), "the winners together, larger")

    # ---------------------------------------------------------------- the finals
    def finals(self) -> None:
        """The leaders and the reference measured again, interleaved (the order reversed each
        round, so that a drift of the machine hits both sides alike), until each leader is decided
        or ``tune.max_rounds`` rounds were run."""
        ref = self.timing_reference()
        leaders = self.finalists()
        if ref is None or not leaders:
            return
        while self.rounds < self.tune.max_rounds and leaders and not self.over_budget():
            order = [ref, *leaders]
            for row in (order if self.rounds % 2 else order[::-1]):
                self.run_once(row, measure_sample=False)
                self.judge()
                self.progress(row, self)
            self.rounds += 1
            if self.rounds >= self.tune.rounds:  # beyond the rounds asked for: only the undecided that could win
                leaders = [r for r in leaders if r.verdict == stats.NOISY and r.vs_reference.ratio < 1]

    def interrupt(self, signum: int | None) -> None:
        """A stop: the row being measured (and any planned) ends ``interrupted``."""
        for row in self.rows:
            if row.status in ("planned", "running"):
                row.status = "interrupted"
                row.reason = f"stopped by {signal_name(signum)} before its run finished"
        self.judge()

