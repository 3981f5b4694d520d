"""tune's parts in-process: reading a run into the job's time, the search's order, the choice, the noise rules, dropout (the command-line tests: tests/cli/test_tune.py)."""
import json
from pathlib import Path
import pytest


def test_tune_says_when_the_machine_is_oversubscribed_and_keys_its_cache_on_the_threads(capsys):
    from looplib.tune.driver import cache_file, finish, oversubscribed, warn_oversubscribed
    from looplib.tune.settings import Tune
    quiet = {"cores": 2, "threads": 1, "processes": 2, "cpu": True}
    assert oversubscribed(quiet, 1.5) is None
    assert oversubscribed(quiet, 4.6) == "load 4.6 on 2 cores"
    assert oversubscribed(dict(quiet, threads=2), 0.5) == "2 threads x 2 process(es) on 2 cores"
    assert oversubscribed(dict(quiet, threads=8, cpu=False), 0.5) is None  # on a GPU the runs' threads wait on it
    warn_oversubscribed("load 4.6 on 2 cores", True, "as tune starts")
    finish({"rows": [], "elapsed_s": 60.0, "cost": {"job_s": 5.3}, "best": None,
            "load": {"min": 4.1, "max": 4.6, "oversubscribed": "load 4.6 on 2 cores"}}, Path("/tmp/t"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[tune] the machine is oversubscribed as tune starts (load 4.6 on 2 cores): ")
    assert out[1].startswith("[tune] 0 candidates in 60 s (11.3x the job as given, predicted 5.3 s); ")
    assert out[2].startswith("[tune] measured on an oversubscribed machine (load 4.6 on 2 cores; load 4.1-4.6)")
    job = ["model.n_layer=1"]
    assert cache_file(job, Tune(), "cpu", 1, 1) != cache_file(job, Tune(), "cpu", 1, 4)  # other threads: measured again
    assert cache_file(job, Tune(), "cpu", 1, 1) == cache_file(job, Tune(fresh=True), "cpu", 1, 1)


def test_a_run_is_read_into_the_parts_of_the_jobs_time(tmp_path):
    """From a run's metrics.jsonl: startup (started_at against the process's start), the warm-up,
    each timed interval's step time less a recompile inside it (counted once, where it happened),
    the evaluations, the save and the sample; the job's time extrapolates what it does more of."""
    from looplib.tune.objective import JobPlan, breakdown, predict, read_run
    rows = [{"step": 1, "loss": 1.0, "step_time_s": 2.0, "elapsed_s": 2.0, "started_at": 103.0, "compile_s": 1.8},
            {"step": 2, "loss": 1.0, "step_time_s": 0.1, "elapsed_s": 2.1, "compile_s": 1.8},
            {"step": 4, "loss": 1.0, "step_time_s": 0.1, "elapsed_s": 2.3, "compile_s": 1.8},
            {"step": 4, "eval_loss": 1.0, "eval_s": 0.5, "compile_s": 2.2},          # eval mode compiled
            {"step": 6, "loss": 1.0, "step_time_s": 0.6, "elapsed_s": 3.9, "compile_s": 3.2},  # a new shape: 1 s
            {"step": 6, "eval_loss": 1.0, "eval_s": 0.2, "compile_s": 3.2},
            {"step": 6, "compile_s": 3.2, "compiles": 4, "checkpoint_s": 0.3, "checkpoints": 1},
            {"step": 6, "sample_s": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run = read_run(tmp_path / "metrics.jsonl", 2, spawned=100.0, ended=110.0, load=1.0)
    assert run.startup_s == 3.0 and run.warmup_s == 2.1 and run.recompiled_at == [6]
    assert run.step_s == pytest.approx([0.1, 0.1])  # (0.6 x 2 - 1 s of recompiling) / 2
    assert run.evals_s == [0.5, 0.2] and run.save_s == 0.3 and run.sample_s == 1.5 and run.compiles == 4
    plan = JobPlan(max_steps=100, eval_every=10, eval_samples=4, checkpoint=True, checkpoint_every=50, sample_tokens=9)
    assert (plan.evaluations(), plan.saves()) == (10, 2)
    # 10 s measured + 94 more steps + 8 more evaluations at the later one's 0.2 s + 1 more save; the sample was in it
    assert predict(run, plan, 1.5) == pytest.approx(10 + 94 * 0.1 + 8 * 0.2 + 0.3)
    parts = breakdown(run, plan, 1.5)
    assert parts["steps"] == pytest.approx(10.0) and parts["evaluations"] == pytest.approx(0.5 + 9 * 0.2)
    assert parts["warmup"] == pytest.approx(2.1 - 0.2) and parts["sample"] == 1.5 and parts["checkpoints"] == 0.6
    assert plan.measurement(2, 2, sample=False) == [
        "max_steps=6", "log_every=2", "progress=lines", "resume=null", "eval_every=4", "eval_samples=4",
        "checkpoint.enabled=true", "checkpoint.every_steps=0", "checkpoint.keep=1", "sample_tokens=0"]


def test_the_search_primes_confirms_and_interleaves_its_finals(monkeypatch):
    """The search's order of runs, with the runs faked (no process): the caches primed first (the
    job as given, one step; a compiling candidate once before its first timed run), a leader that
    beat the reference in one run measured again beside it before the other dimensions are varied
    from it, a noisy run measured again and set aside, and the finals interleaved with the
    reference, the order reversed each round."""
    from pathlib import Path
    from looplib.tune.measure import Outcome
    from looplib.tune.objective import JobPlan, Run
    from looplib.tune.search import Search
    from looplib.tune.settings import Tune
    from looplib.tune.space import Space
    step = {"as given": 0.05, "2x2": 0.04, "1x4": 0.07, "2x2 compile=default": 0.06}
    calls = []

    def fake(self, row, measurement, env=None, warmup=None):
        label, timed = row.candidate.label(), measurement[0] == "max_steps=16"  # (3 + 1) x 4 steps; primes: fewer
        calls.append(label if timed else f"prime {label}")
        noisy = label == "as given" and calls.count("as given") == 1  # its first timed run: one slow interval
        steps = [step[label] * (20 if noisy else 1), step[label], step[label]]
        run = Run(total_s=5.0, startup_s=2.0, steps=16, warmup_steps=4, warmup_s=0.5, step_s=steps)
        return Outcome("measured", samples_per_s=4 / steps[1], spread=(max(steps) - min(steps)) / steps[1],
                       loss=1.0, repeats=[4 / x for x in steps], timing=run)
    monkeypatch.setattr(Search, "measure", fake)
    space = Space(4, (4, 1), {"batch": ["4", "2", "1"], "compile": ["none", "default"]})
    tune = Tune(finalists=1, rounds=2, max_rounds=2, max_spread=1.0)
    search = Search(space, [], tune, Path("."), plan=lambda c: None, limit=None, job_plan=JobPlan(1000))
    search.run()
    assert calls == ["prime as given",
                     "as given", "as given",                    # noisy, measured again (the first set aside)
                     "2x2", "1x4",                              # micro-batches, largest first
                     "2x2", "as given",                         # the leader confirmed beside the reference
                     "prime 2x2 compile=default", "2x2 compile=default",  # compile, from the leader
                     "2x2", "as given",                         # finals round 1: the reference last
                     "as given", "2x2"]                         # round 2: reversed
    given, leader = search.row(search.rows[0].candidate), search.rows[1]
    assert len(given.set_aside) == 1 and len(given.runs) == 4 and len(leader.runs) == 4
    assert search.rounds == 2 and leader.vs_reference.runs == 4 and leader.verdict == "faster"
    assert search.choice is leader and search.primes[0]["candidate"] == "as given"


def synthetic(job_plan, times_ref, times_compile):
    """A search over the job as given and +compile=default whose runs are given, not measured:
    each run ``(startup, warm-up, step seconds)`` of a 16-step run."""
    from pathlib import Path
    from looplib.tune.measure import Outcome
    from looplib.tune.objective import Run
    from looplib.tune.search import Row, Search
    from looplib.tune.settings import Tune
    from looplib.tune.space import Candidate, Space

    def row(c, runs):
        outcomes = [Outcome("measured", timing=Run(total_s=start + warm + 12 * step + 1.0, startup_s=start, steps=16,
                                                   warmup_steps=4, warmup_s=warm, step_s=[step] * 3))
                    for start, warm, step in runs]
        return Row(c, [], "measured", outcome=outcomes[0], runs=outcomes)
    search = Search(Space(4, (4, 1)), [], Tune(), Path("."), plan=lambda c: None, limit=None, job_plan=job_plan)
    search.rows = [row(Candidate(), times_ref), row(Candidate().with_(compile="default"), times_compile)]
    search.decide()
    return search


@pytest.mark.parametrize("max_steps,chosen", [(24, "as given"), (100_000, "compile=default")])
def test_the_choice_is_the_time_to_finish_this_job(max_steps, chosen):
    """The same measured runs (compile: 20 s more warm-up, 30 ms a step less): for 24 steps the job
    as given finishes first; for 100,000 steps +compile does, beyond the noise; it pays for itself
    after (20 s + 0.3 s) / 30 ms ~ 677 steps either way."""
    from looplib.tune.objective import JobPlan
    ref = [(3.0, 0.2, 0.040), (3.2, 0.25, 0.041), (2.9, 0.2, 0.039)]
    compiled = [(3.1, 20.5, 0.010), (3.0, 20.0, 0.011), (3.3, 21.0, 0.010)]
    search = synthetic(JobPlan(max_steps), ref, compiled)
    assert search.choice.candidate.label() == chosen
    row = search.rows[1]
    assert row.verdict == ("slower" if max_steps == 24 else "faster")
    assert 500 < search.pays_off_after(row) < 900


def test_without_finals_nothing_is_called_faster_or_beyond_the_noise():
    """One run each (no finals: tune.finalists=0, or the budget): +compile looks 10x faster in its one
    run, yet it is not chosen, and the reason says why instead of claiming anything about noise."""
    from looplib.tune.objective import JobPlan
    search = synthetic(JobPlan(10_000), [(3.0, 0.2, 0.040)], [(3.0, 0.2, 0.004)])
    assert search.choice.candidate.label() == "as given" and search.rows[1].verdict == "measured once"
    assert search.why.startswith("no candidate was measured again beside the reference") and "noise" not in search.why


def test_a_leader_within_noise_is_not_chosen_over_the_simpler_job():
    """Runs that scatter +-30%: the interval holds 1, so the job as given (simpler) is kept and the
    report says the machine was too noisy to decide."""
    from looplib.tune.objective import JobPlan
    ref = [(3.0, 0.2, 0.040), (3.0, 0.2, 0.060), (3.0, 0.2, 0.030)]
    compiled = [(3.0, 0.2, 0.035), (3.0, 0.2, 0.050), (3.0, 0.2, 0.028)]
    search = synthetic(JobPlan(10_000), ref, compiled)
    assert search.choice.candidate.label() == "as given"
    assert search.rows[1].verdict == "too noisy to decide" and "too noisy to decide" in search.why


@pytest.mark.parametrize("dropout,status", [(0.0, "error"), (0.1, "measured")])
def test_a_model_with_dropout_is_held_to_the_loss_tolerance(dropout, status):
    """Dropout draws other masks when the micro-batch changes (bert_tiny's 0.1 moved the loss by
    0.15-0.4% in the benchmark): there a same-math candidate is held to tune.loss_tolerance, not
    to tune.tolerance (which would call it a bug)."""
    from pathlib import Path
    from looplib.tune.measure import Outcome
    from looplib.tune.search import Row, Search
    from looplib.tune.settings import Tune
    from looplib.tune.space import Candidate, Space
    search = Search(Space(4, (4, 1)), [], Tune(), Path("."), plan=lambda c: None, limit=None)
    ref, other = (Row(c, [], "measured", outcome=Outcome("measured", loss=loss, dropout=dropout))
                  for c, loss in ((Candidate(), 0.700), (Candidate().with_(batch=(2, 2)), 0.703)))
    search.rows = [ref, other]
    search.check_numerics(ref)
    search.check_numerics(other)
    assert other.status == status and other.loss_delta == pytest.approx(0.003)
