"""The session runs a typed job as named steps, in order, in-process: a fake engine records what
each step asked of it, recipes record when they are built, and a refusal at the check builds
nothing and leaves nothing behind."""
from dataclasses import fields

import pytest

from conftest import random_tokens, tiny_gpt
from looplib import groups
from looplib.engines import Engine
from looplib.errors import ConfigError
from looplib.process.collectives import Ranks
from looplib.run.assembly import JobSpec, Parts, Recipe, Record
from looplib.run.session import Session
from looplib.run.settings import settings_from
from looplib.run.signals import Signals
from looplib.run.api import Datasets
from looplib.schedule import WarmupCosine


class SaidRanks(Ranks):
    """One process's collectives, saying which the session called (into the engine's list)."""

    def agree(self, config):
        self.engine.said.append("agree")
        return super().agree(config)

    def shared_run_dir(self, run_dir):
        self.engine.said.append("claim")
        return super().shared_run_dir(run_dir)


class Recording(Engine):
    """The local engine, saying which of its verbs (and of its collectives') the session called, in order."""

    collectives = SaidRanks

    def __init__(self, said: list):
        super().__init__("cpu")
        self.said = said

    def setup(self, model):
        self.said.append("setup")
        return super().setup(model)

    def close(self):
        self.said.append("close")
        return super().close()


class Built(Recipe):
    def __init__(self, said: list, name: str, make):
        self.said, self.name, self.make = said, name, make

    def build(self, expected=None):
        self.said.append(f"build {self.name}")
        return self.make()


def spec(said: list, **settings) -> JobSpec:
    parts = Parts.of(model=Built(said, "model", tiny_gpt), data=Built(said, "data", lambda: Datasets(random_tokens(), None, None)),
                     engine=Recording(said))
    values = dict(device="cpu", max_steps=2, batch_size=4, log_every=1, eval_every=0, eval_samples=0, sample_tokens=0,
                  progress="lines", checkpoint={"enabled": False})
    return JobSpec(parts, settings_from({**values, **settings}), Record({"job": "session test"}))


def test_the_parts_hold_one_typed_field_per_group_and_groups_of_ones_own_beside_them():
    typed = {f.name for f in fields(Parts)} - {"more"}
    assert typed == {row.part for row in groups.GROUPS}, "a group's row and its field of Parts go together"
    with pytest.raises(TypeError, match="no config group holds"):
        Parts.of(nothing=1)


def test_a_session_checks_claims_builds_trains_and_closes_in_that_order(tmp_path):
    said: list = []
    with Session(tmp_path / "run", Signals(), fresh=True) as session:
        trained = session.run(spec(said))
    assert said == ["agree", "claim", "build data", "build model", "setup", "close"]
    assert trained.state.step == 2 and (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_refusal_at_the_check_builds_nothing_and_leaves_no_directory(tmp_path):
    said: list = []
    job = spec(said, max_steps=3)
    job.parts.schedule = WarmupCosine(warmup_steps=5)  # a warm-up longer than the run: refused at the check
    with pytest.raises(ConfigError) as refused:
        with Session(tmp_path / "run", Signals(), fresh=True) as session:
            (tmp_path / "run").mkdir()  # as Hydra makes it before the job runs
            session.run(job)
    assert "warmup_steps" in refused.value.line and refused.value.status == 2
    assert said == []  # no rank agreed to a job that failed its own check, nothing built
    assert not (tmp_path / "run").exists()


def test_a_refusal_while_the_caller_builds_its_job_is_said_and_cleaned_up_alike(tmp_path):
    with pytest.raises(ConfigError) as refused:
        with Session(tmp_path / "run", Signals(), fresh=True):
            (tmp_path / "run").mkdir()
            settings_from({"max_steps": -1})  # the caller's own check, inside the session
    assert refused.value.line.startswith("looplib: error: max_steps")
    assert not (tmp_path / "run").exists()


def test_docs_extending_holds_the_list_of_rules():
    from conftest import REPO
    from looplib.run import rules
    assert rules.table() in (REPO / "docs" / "extending.md").read_text(), \
        "regenerate: python -c 'from looplib.run import rules; print(rules.table())'"


def test_every_rule_between_strategies_is_asked_from_the_one_list(monkeypatch):
    """Taking a rule out of RULES takes it out of the run: the job it refused is then built."""
    from looplib.run import rules
    said: list = []
    job = spec(said, max_steps=3)
    job.parts.schedule = WarmupCosine(warmup_steps=5)
    from looplib.run.assembly import check
    with pytest.raises(ConfigError, match="warmup_steps"):
        check(job.parts, job.settings)
    monkeypatch.setattr(rules, "RULES", [r for r in rules.RULES if "warm-up" not in r.name])
    check(job.parts, job.settings)  # nothing else refuses it


class PeerSignalled(Ranks):
    """One process's collectives, but another rank has been signalled: the checkpoints' agreement on
    a stop (requested, signalled) says yes to both; any other agreement is this process's own."""

    def any_of(self, *flags):
        return [True, True] if len(flags) == 2 else [bool(f) for f in flags]


class StoppedByPeer(Engine):
    collectives = PeerSignalled

    def __init__(self):
        super().__init__("cpu")


def test_a_rank_stopped_with_a_signalled_rank_saves_and_ends_as_preempted_not_finished(tmp_path, caplog):
    """Issue 43: a rank stopped by agreement, without a signal of its own (only rank 0 signalled, or
    another node's launcher gone), saved and exited 0 as if the run had finished. It now ends as the
    signalled rank does: Interrupted, exit 75, its checkpoint saved, and rank 0 says how to continue."""
    import logging

    from looplib.errors import EXIT_PREEMPTED, Interrupted
    job = spec([], max_steps=4, checkpoint={"enabled": True, "every_steps": 0})
    job.parts.engine = StoppedByPeer()
    with caplog.at_level(logging.WARNING, logger="looplib"), pytest.raises(Interrupted) as stopped:
        with Session(tmp_path / "run", Signals(), fresh=True) as session:
            session.run(job)
    assert stopped.value.status == EXIT_PREEMPTED and stopped.value.result.state.step == 1
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-00000001"]
    assert any("stopped with another rank" in r.getMessage() and "Continue with" in r.getMessage()
               for r in caplog.records)
