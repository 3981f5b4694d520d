"""``python -m looplib.tune [the job's overrides] [tune.* settings]``: the command line of
``looplib.tune`` (split into the job and tune's settings, the job composed by Hydra, planned
and measured)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..engines.launch import relaunch
from ..errors import EXIT_CONFIG, ConfigError, Interrupted, exit_status, signal_name
from ..schema import check_options, refuse_unknown
from ..tune import stats
from ..tune.objective import JobPlan
from ..tune.report import command, row_dict, write
from ..tune.search import MB, Row, Search
from ..tune.settings import Tune, job_without_measurement, pinned, without
from ..tune.space import Candidate, Space, build_space


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
    from hydra import compose as hydra_compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from .args import explain, follow_advice
    for _ in range(2):  # Hydra's "use +key=value" followed once, as python -m looplib.train does
        try:
            with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
                return hydra_compose(config_name="config", overrides=job)
        except (HydraException, OmegaConfBaseException) as err:
            advised = follow_advice(str(err), job)
            if advised is None:
                key, _, problem = explain(err).partition(": ")
                raise ConfigError(key, problem, "the job takes the overrides python -m looplib.train takes") from None
            job = advised
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


def memory_limit(tune, device) -> tuple[int | None, str]:
    import torch
    if tune.memory_gib is not None:
        total, what = int(tune.memory_gib * 2**30), f"tune.memory_gib={tune.memory_gib:g}"
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        what = f"{torch.cuda.get_device_name(device)}'s {total / 2**30:.0f} GiB"
    else:
        return None, "no limit on the CPU (set tune.memory_gib to plan for one)"
    if device.type != "cuda":
        what += " (on the CPU the limit holds the plan; the measured resident memory also counts the process's own)"
    return int(total * (1 - tune.margin)), f"{what}, {tune.margin:.0%} kept free"


def cache_file(cmd: Command, device_name: str, world: int) -> Path:
    import torch
    from ..version import __version__
    from ..data.tokenizer import cache_root
    versions = {"torch": torch.__version__, "looplib": __version__}
    for module in ("transformers", "deepspeed", "bitsandbytes"):
        if module in sys.modules:
            versions[module] = getattr(sys.modules[module], "__version__", "?")
    settings = {k: v for k, v in vars(cmd.tune).items() if k not in ("fresh", "dry_run")}
    blob = json.dumps({"device": device_name, "versions": versions, "world": world, "job": cmd.job,
                       "tune": settings}, sort_keys=True, default=str)
    return cache_root() / "tune" / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"


class Progress:
    """A bar on a terminal (candidate, best so far), a line per candidate otherwise; rank 0 only."""

    def __init__(self, main: bool):
        self.main, self.bar = main, None
        if main and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(unit="candidate", dynamic_ncols=True)

    def __call__(self, row: Row, search: Search) -> None:
        if not self.main:
            return
        best = search.best()
        best_row = search.row(best) if best else None
        best_text = (f"best so far {best.label()} ({search.time(best_row):,.1f} s)" if best_row and best_row.measured
                     else "best: none yet")
        o = row.outcome
        ref = search.timing_reference()
        versus = ("the reference" if row is ref or ref is None or not row.measured
                  else stats.ratio(search.times(row), search.times(ref)).text() + " the reference's")
        what = (f"job {search.time(row):,.1f} s ({versus}, run {len(row.runs)}), {row.speed:,.2f} samples/s, "
                f"{o.peak_mem_mb:,.0f} MB" + (f", compile {o.compile_s:.1f} s" if o.compile_s else "")
                if row.measured and o else row.reason)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(best_text)
            self.bar.write(f"[tune] {row.candidate.label()}: {row.status}: {what}")
        else:
            print(f"[tune] {search.rows.index(row) + 1}: {row.candidate.label()}: {row.status}: {what}; {best_text}",
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run(argv: list[str]) -> int:
    from ..tune.measure import World
    from .args import normalise

    cmd = split(argv)
    cmd.job = normalise(cmd.job)  # precision=bf16 and +precision=bf16 alike, as python -m looplib.train takes them
    world = World() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    try:
        status = tuned(cmd, world)
    except BaseException:
        if world is not None:  # the other ranks may be inside a collective: no barrier to wait on
            world.close(together=False)
        raise
    if world is not None:
        world.close()
    return status


def tuned(cmd: Command, world) -> int:
    """The search of ``cmd`` (``world``: the tuners' process group under torchrun, or None)."""
    from .instantiate import check_config
    from ..engines.local import resolve_device
    from ..run.rundir import check as check_run_dir
    from ..run.signals import Signals
    size, main = (world.size, world.rank == 0) if world else (1, True)
    cfg = compose(cmd.job)
    settings = check_config(cfg)
    device = resolve_device(settings.device)
    import torch
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    space = build_space(cmd.tune, cmd.job, settings, device, size, str(cfg.loss.get("_target_", "")), pinned(cmd.job))
    limit, memory = memory_limit(cmd.tune, device)
    run_dir = cmd.run_dir.absolute()
    if world:
        run_dir = Path(world.broadcast(str(run_dir)))
    check_run_dir(run_dir, None, "hydra.run.dir")
    cached = cache_file(cmd, device_name, size)
    if cached.exists() and not cmd.tune.fresh and not cmd.tune.dry_run:
        result = json.loads(cached.read_text())
        if main:
            write(run_dir, result)
            print(f"[tune] the same job was measured on {result['date']} (cached in {cached}; tune.fresh=true "
                  "measures again)")
            finish(result, run_dir)
        return 0
    job = job_without_measurement(cmd.job)
    job_plan = JobPlan.of(settings)
    signals = Signals().__enter__()  # SIGTERM, SIGUSR1, Ctrl-C: the running candidate goes, the rows are written
    stopped = None
    search = Search(space, job, cmd.tune, run_dir, planner(job, space, size), limit, job_plan, world,
                    limit_measured=device.type == "cuda", progress=Progress(main),
                    stop=lambda: signals.signum, note=lambda text: main and print(f"[tune] {text}", flush=True))
    loads = [os.getloadavg()[0]]
    try:
        with signals.deferred():  # a signal sets a flag; the search polls it (a second Ctrl-C: at once)
            try:
                if cmd.tune.dry_run:
                    dry_run(search)
                else:
                    search.run()
            except Interrupted as stop:
                stopped = stop.signum
        stopped = stopped or signals.signum
        signals.finish()  # from here a signal changes nothing: the rows are written whole
        if stopped:
            search.interrupt(stopped)
        result = outcome(cmd, search, device, device_name, size, memory, job_plan, stopped,
                         loads + [os.getloadavg()[0]] + [o.timing.load for r in search.rows for o in r.runs
                                                         if o.timing and o.timing.load is not None])
        if world:  # every rank took the same decisions from the same agreed outcomes: checked, not assumed
            result["ranks"] = world.gather(result["best"] and result["best"]["candidate"])
            if len(set(result["ranks"])) != 1:
                raise ConfigError("tune", f"the ranks chose different candidates ({result['ranks']})",
                                  "this is a bug in looplib.tune: please report it with tune.json")
        if main:
            write(run_dir, result)
            if not stopped and not cmd.tune.dry_run:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(result) + "\n")
            finish(result, run_dir)
    finally:
        search.progress.close()
        signals.__exit__()
    return exit_status(stopped) if stopped else 0


def outcome(cmd: Command, search: Search, device, device_name: str, size: int, memory: str, job_plan: JobPlan,
            stopped: int | None, loads: list[float]) -> dict:
    """tune.json's content: the settings, the job's plan, every row, the decision and the best command."""
    best = search.best()
    best_row = search.row(best) if best else None
    ref = search.timing_reference()
    return {"device": device_name, "world": size, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "job": cmd.job,
            "tune": vars(cmd.tune), "memory": memory, "dimensions": search.space.options,
            "objective": job_plan.describe(), "job_plan": vars(job_plan),
            "peak_mem_measures": ("GPU memory allocated by torch tensors (peak)" if device.type == "cuda" else
                                  "the rise of the process's resident memory during the run (RSS peak - RSS at start)"),
            "load": {"min": round(min(loads), 2), "max": round(max(loads), 2), "cores": os.cpu_count()},
            "interrupted": bool(stopped), "stopped_by": signal_name(stopped) if stopped else None,
            "elapsed_s": round(search.elapsed(), 1), "rounds": search.rounds, "primed": search.primes,
            "rows": [row_dict(r, search) for r in search.rows],
            "decision": None if best_row is None else {
                "candidate": best.label(), "why": search.why if search.choice is not None else
                "the best so far (the search was stopped before its finals)",
                "reference": ref.candidate.label() if ref else None, "too_noisy": search.too_noisy},
            "best": None if best_row is None else {
                "overrides": best_row.overrides, "candidate": best.label(),
                "command": command(without(cmd.job, best_row.overrides), best_row.overrides, relaunch("looplib.train")),
                "job_s": round(search.time(best_row), 2) if best_row.measured else None,
                "samples_per_s": best_row.speed}}


def dry_run(search: Search) -> None:
    """Plan the micro-batch x checkpointing grid and each other option from the job: nothing runs."""
    space = search.space
    micro = [int(b) for b in space.options.get("batch", [])] or [0]
    grid = [Candidate().with_(batch=(b, space.per_rank // b) if b else (0, 0), checkpointing=o)
            for o in [None] + [x for x in space.options.get("checkpointing", []) if x != "none"] for b in micro]
    grid += [Candidate().with_(**{d: o}) for d, opts in space.options.items()
             if d not in ("batch", "checkpointing") for o in opts[1:]]
    for c in grid:
        if search.row(c) is None:
            planned = search.plan(c)
            row = Row(c, space.overrides(c), stage="dry run")
            row.planned_mem_mb = None if planned is None else round(planned / MB, 1)
            over = planned is not None and search.limit is not None and planned > search.limit
            row.status = "pruned" if over else "skipped"
            row.reason = "over the usable memory" if over else "dry run: planned only"
            search.rows.append(row)
            search.progress(row, search)


def finish(result: dict, run_dir: Path) -> None:
    print(f"[tune] {len(result['rows'])} candidates in {result['elapsed_s']:.0f} s; tune.json, tune.md, tune.png in "
          f"{run_dir}", flush=True)
    decision = result.get("decision")
    if result.get("interrupted"):
        print(f"[tune] stopped by {result['stopped_by']}: what was measured is in tune.json; the best so far "
              "(not confirmed by the finals):", flush=True)
    elif decision:
        best = result["best"]
        print(f"[tune] {decision['candidate']}: {decision['why']}"
              + (f" (predicted {best['job_s']:,.1f} s for the job)" if best.get("job_s") else ""), flush=True)
    if result["best"]:
        print(result["best"]["command"], flush=True)  # last: ready to paste
    else:
        print("[tune] no candidate was measured (see tune.md for each one's reason)", flush=True)


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
    try:
        return run(argv)
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"looplib: error: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG

