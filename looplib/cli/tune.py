"""``python -m looplib.tune [the job's overrides] [tune.* settings]``: the command line of
``looplib.tune``, only what needs Hydra: the arguments split into the job and tune's settings,
the job composed and checked, the planner that composes each candidate. The search's life
(cache, signals, the ranks, tune.json) is ``looplib.tune.driver``'s."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import EXIT_CONFIG, ConfigError, Interrupted
from ..schema import check_options, refuse_unknown
from ..tune import driver
from ..tune.driver import Job
from ..tune.settings import Tune, without
from ..tune.space import Candidate, Space


@dataclass
class Command:
    """The command line, split."""
    job: list[str]            # the job's overrides, as typed
    tune: Tune
    run_dir: Path


def parse_value(arg: str) -> Any:
    """An override's value as Hydra reads it (``[a,b]`` a list, ``16`` an int, ``null`` None)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    try:
        return OverridesParser.create().parse_overrides([arg])[0].value()
    except HydraException as err:
        key = arg.split("=", 1)[0]
        raise ConfigError(key, f"{arg!r} does not parse: {' '.join(str(err).split())[:160]}",
                          f"check the syntax of {key}") from None


def split(argv: list[str]) -> Command:
    """The job's overrides, the ``tune.*`` settings (checked) and the run directory."""
    job, values, run_dir = [], {}, None
    for arg in argv:
        key, eq, _ = arg.lstrip("+").partition("=")
        if arg.startswith("-"):
            raise ConfigError(arg, "is not an option of python -m looplib.tune",
                              "give the job's overrides and tune.* settings, e.g. tune.budget_s=600")
        if key == "hydra.run.dir":
            run_dir = Path(str(parse_value(arg)))
        elif key == "tune" or key.startswith("tune."):
            if not eq:
                raise ConfigError(key, f"{arg} has no value", f"use {key}=VALUE")
            parts = key.split(".")[1:]
            if parts[:1] == ["options"] and len(parts) == 2:
                values.setdefault("options", {})[parts[1]] = parse_value(arg)
            elif len(parts) == 1:
                values[parts[0]] = parse_value(arg)
            else:
                raise ConfigError(key, f"{key} is not a tune setting", "use tune.NAME=VALUE or tune.options.DIM=[...]")
        else:
            job.append(arg)
    names = [f.name for f in fields(Tune)]
    for key in values:
        if key not in names:
            refuse_unknown("tune.", key, values[key], names)
    check_options("tune.", Tune, values)
    tune = Tune(**values)
    if run_dir is None:
        run_dir = Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    return Command(job, tune, run_dir)


def compose(job: list[str]):
    """The job's config as python -m looplib.train composes it: as written where Hydra takes it (each
    candidate's overrides are looplib's own), else settled first (``looplib.cli.args.settle``: the
    same forgiving ``+``, the same refusals, here a ``ConfigError``)."""
    from hydra import compose as hydra_compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .args import Refusal, settle
    try:
        with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
            return hydra_compose(config_name="config", overrides=job)
    except (HydraException, OmegaConfBaseException):
        pass
    try:
        job = settle(job)
    except Refusal as refused:
        key, _, problem = refused.line.partition(": ")
        raise ConfigError(key, problem, "the job takes the overrides python -m looplib.train takes") from None
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=job)


def planner(job: list[str], space: Space, world: int):
    """Planned bytes per rank of a candidate (``looplib.plan``), or None where it cannot say."""
    from ..plan import zero_per_rank
    from .plan import build_plan

    def plan(c: Candidate) -> int | None:
        overrides = space.overrides(c)
        try:
            p = build_plan(compose([*without(job, overrides), *overrides]), world, memory=1)
        except Exception:  # noqa: BLE001 - a model the planner cannot build on meta: measure it anyway
            return None
        micro = c.micro_batch or space.job_batch[0] or 1
        act = p.activations.at(micro)
        engine = c.get("engine", "ddp")
        if engine.startswith("fsdp"):
            return p.fsdp(offload=engine.endswith("offload")) + act
        if engine.startswith("zero"):
            stage, offload = int(engine[4]), engine.endswith("offload")
            return zero_per_rank(*p.zero_layout(), world, stage, offload, False) + act
        return p.peak(micro)
    return plan


def describe(job: list[str]) -> Job:
    """The job composed by Hydra and checked, with the planner that composes each candidate."""
    from .instantiate import check_config
    cfg = compose(job)
    warmup = "warmup_steps" in (cfg.get("schedule") or {})  # the runs in small are shorter than the warm-up
    model = cfg.get("model") or {}
    random = str(model.get("_target_", "")).startswith(("looplib.models.", "looplib.hf.")) \
        and not model.get("path") and not model.get("init_from")  # looplib.store.init_from.untrained, from the config
    return Job(job, check_config(cfg), str(cfg.loss.get("_target_", "")), planner,
               ["schedule.warmup_steps=0"] if warmup else [], trained_base=not random)


def run(argv: list[str]) -> int:
    from .args import normalise
    cmd = split(argv)
    cmd.job = normalise(cmd.job)  # precision=bf16 and +precision=bf16 alike, as python -m looplib.train takes them
    return driver.run(cmd.job, cmd.tune, cmd.run_dir, describe)


def usage() -> str:
    """``--help``: what looplib.tune does, and every ``tune.*`` key with its default."""
    from dataclasses import MISSING

    from .. import tune
    from ..schema import cli
    lines = ["usage: python -m looplib.tune [the job's overrides, as python -m looplib.train takes them] "
             "[tune.KEY=VALUE ...]", "", tune.__doc__.strip(), "", "tune.* settings (default):"]
    for f in fields(Tune):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  tune.{f.name}={cli(default)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    from ..store.rundir import write_exit_status
    try:
        status = run(argv)
    except ConfigError as err:
        # every rank that refuses says so (under torchrun the ranks refuse alike, and the launcher may stop
        # rank 0 as soon as another rank exits: a line said by rank 0 alone could be lost)
        print(f"looplib: error: {err}", file=sys.stderr, flush=True)
        status = EXIT_CONFIG
    except Interrupted as stop:  # a signal before the search began (composing, planning): nothing measured
        print(f"looplib: stopped ({stop}) before tune started measuring; nothing was written", file=sys.stderr,
              flush=True)
        status = stop.status
    write_exit_status(status)  # LOOPLIB_EXIT_FILE (rank 0): 2 for a refusal, 75 or 130 after a signal
    return status
