"""One search's life, with no Hydra in it: the job described (its settings, loss and planner, by
the command line), the space built, the cache asked, the search run under the run's signals,
tune.json / tune.md / tune.png written and the best command printed last.

Under torchrun every rank runs its own tuner (``world.World``): the ranks take the same decisions
from the same agreed outcomes, and however one of them is stopped (a signal to one rank), every
rank stops, kills its candidate's process group, and rank 0 writes what was measured.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, Interrupted, exit_status, signal_name
from . import stats
from .objective import JobPlan
from .report import command, row_dict, write
from .search import MB, Row, Search
from .settings import Tune, job_without_measurement, pinned, without
from .space import Candidate, Space, build_space


@dataclass
class Job:
    """The job to tune, as the command line described it."""
    overrides: list[str]          # as typed (normalised: +group= and group= alike)
    settings: object              # looplib.run.settings.Settings, checked
    loss: str                     # the loss's _target_ (the chunked loss is a candidate only for the default)
    # (job overrides, space, processes) -> planned bytes per rank of a candidate (None: cannot say)
    planner: Callable[[list[str], Space, int], Callable[[Candidate], int | None]]
    # overrides every measuring run adds (a schedule's warm-up set to 0: the job in small is shorter
    # than its warm-up, which a run refuses; the lr's value does not change a step's time)
    measuring: list[str] = field(default_factory=list)
    trained_base: bool = True     # False: the model starts from random weights (no adapter candidates)


def run(job_overrides: list[str], tune: Tune, run_dir: Path, describe: Callable[[list[str]], Job]) -> int:
    """Tune the job (``describe`` composes and checks it) into ``run_dir``; the exit status."""
    from .world import World
    world = World() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    try:
        status = tuned(job_overrides, tune, run_dir, describe, world)
    except BaseException:
        if world is not None:
            world.close(together=False)  # an error on this rank: no waiting on the others
        raise
    if world is not None:
        world.close()
    return status


def memory_limit(tune: Tune, device) -> tuple[int | None, str]:
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


def machine(device) -> dict:
    """What the runs are measured under: the cores this process may use, the threads torch gives
    each run (``OMP_NUM_THREADS``, else torch's default; the runs inherit it), the processes on this
    host (a tuner and its run per rank), and the load now."""
    import torch
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"cores": cores, "threads": torch.get_num_threads(),
            "processes": int(os.environ.get("LOCAL_WORLD_SIZE", "1")), "cpu": device.type == "cpu",
            "load": round(os.getloadavg()[0], 2)}


def oversubscribed(m: dict, load: float) -> str | None:
    """Why the machine is oversubscribed for the runs (None: it is not): a load above its cores, or
    (measuring on the CPU) more threads x processes than cores."""
    why = []
    if load > m["cores"]:
        why.append(f"load {load:.1f} on {m['cores']} cores")
    if m["cpu"] and m["threads"] * m["processes"] > m["cores"]:
        why.append(f"{m['threads']} threads x {m['processes']} process(es) on {m['cores']} cores")
    return "; ".join(why) or None


def warn_oversubscribed(why: str | None, main: bool, when: str) -> None:
    if why and main:
        print(f"[tune] the machine is oversubscribed {when} ({why}): the runs compete for cores, so they measure "
              "slower and noisier than the job would run alone; set OMP_NUM_THREADS to fit the cores (e.g. "
              "OMP_NUM_THREADS=1), or measure on a quieter machine", flush=True)


def cache_file(job: list[str], tune: Tune, device_name: str, world: int, threads: int) -> Path:
    import torch
    from ..version import __version__
    from ..data.tokenizer import cache_root
    versions = {"torch": torch.__version__, "looplib": __version__}
    for module in ("transformers", "deepspeed", "bitsandbytes"):
        if module in sys.modules:
            versions[module] = getattr(sys.modules[module], "__version__", "?")
    settings = {k: v for k, v in vars(tune).items() if k not in ("fresh", "dry_run")}
    blob = json.dumps({"device": device_name, "versions": versions, "world": world, "threads": threads, "job": job,
                       "tune": settings}, sort_keys=True, default=str)  # another thread count: other timings
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


def tuned(job_overrides: list[str], tune: Tune, run_dir: Path, describe: Callable[[list[str]], Job], world) -> int:
    """The search (``world``: the tuners under torchrun, or None)."""
    import torch
    from ..engines.local import resolve_device
    from ..store.rundir import check as check_run_dir
    from ..run.signals import Signals
    size, main = (world.size, world.rank == 0) if world else (1, True)
    job = describe(job_overrides)
    settings = job.settings
    device = resolve_device(settings.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    space = build_space(tune, job_overrides, settings, device, size, job.loss, pinned(job_overrides), job.trained_base)
    limit, memory = memory_limit(tune, device)
    run_dir = run_dir.absolute()
    if world:
        run_dir = Path(world.broadcast(str(run_dir)))
    check_run_dir(run_dir, None, "hydra.run.dir")
    host = machine(device)
    cached = cache_file(job_overrides, tune, device_name, size, host["threads"])
    if cached.exists() and not tune.fresh and not tune.dry_run:
        result = json.loads(cached.read_text())
        if main:
            write(run_dir, result)
            print(f"[tune] the same job was measured on {result['date']} (cached in {cached}; tune.fresh=true "
                  "measures again)")
            finish(result, run_dir)
        return 0
    measured_job = job_without_measurement(job_overrides)
    measured_job = [*without(measured_job, job.measuring), *job.measuring]
    job_plan = JobPlan.of(settings)
    signals = Signals().__enter__()  # SIGTERM, SIGUSR1, Ctrl-C: the running candidate goes, the rows are written
    if world:
        world.own = lambda: signals.signum  # posted for the other ranks the first time it is read
    stop = world.stopped if world else (lambda: signals.signum)  # this rank's signal, or another rank's
    stopped = None
    search = Search(space, measured_job, tune, run_dir, job.planner(measured_job, space, size), limit, job_plan,
                    world, limit_measured=device.type == "cuda", progress=Progress(main), stop=stop,
                    note=lambda text: main and print(f"[tune] {text}", flush=True))
    loads = [os.getloadavg()[0]]
    warn_oversubscribed(oversubscribed(host, loads[0]), main, "as tune starts")
    if main and not tune.dry_run:  # what it will cost, before it costs it (and once the job as given ran)
        likely, most = search.runs_planned()
        print(f"[tune] the search: about {likely} runs (at most {most}) of the job in small, "
              f"{(tune.repeats + 1) * tune.steps} steps and up to 2 evaluations each, against the job's "
              f"{job_plan.describe()}; at most tune.budget_s={tune.budget_s:g} s", flush=True)
    try:
        with signals.deferred():  # a signal sets a flag; the search polls it (a second Ctrl-C: at once)
            try:
                if tune.dry_run:
                    dry_run(search)
                else:
                    search.run()
            except Interrupted as interrupted:
                stopped = interrupted.signum
        stopped = stopped or signals.signum or (world.stopped() if world else None)
        signals.finish()  # from here a signal changes nothing: the rows are written whole
        if stopped:
            search.interrupt(stopped)
        loads += [os.getloadavg()[0]] + [o.timing.load for r in search.rows for o in r.runs
                                         if o.timing and o.timing.load is not None]
        result = outcome(job_overrides, tune, search, device, device_name, size, memory, job_plan, stopped, loads, host)
        if world:  # every rank took the same decisions from the same agreed outcomes: checked, not assumed
            result["ranks"] = world.gather(result["best"] and result["best"]["candidate"], "end", stoppable=False,
                                           timeout_s=120)
            if stopped:
                result["stopped_on_rank"] = world.stopped_by()
            elif len(set(result["ranks"])) != 1:
                raise ConfigError("tune", f"the ranks chose different candidates ({result['ranks']})",
                                  "this is a bug in looplib.tune: please report it with tune.json")
        if main:
            write(run_dir, result)
            if not stopped and not tune.dry_run:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(result) + "\n")
            finish(result, run_dir)
        elif stopped:
            who = result.get("stopped_on_rank")
            print(f"[tune] rank {world.rank}: stopped by {signal_name(stopped)}"
                  + (f" on rank {who}" if who is not None and who != world.rank else "")
                  + f"; rank 0 writes what was measured to {run_dir / 'tune.json'}", flush=True)
    finally:
        search.progress.close()
        signals.__exit__()
    return exit_status(stopped) if stopped else 0


def outcome(job: list[str], tune: Tune, search: Search, device, device_name: str, size: int, memory: str,
            job_plan: JobPlan, stopped: int | None, loads: list[float], host: dict) -> dict:
    """tune.json's content: the settings, the job's plan, every row, the decision and the best command."""
    from ..process.launcher import relaunch
    best = search.best()
    best_row = search.row(best) if best else None
    ref = search.timing_reference()
    return {"device": device_name, "world": size, "train_with": relaunch("looplib.train"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "job": job,
            "tune": vars(tune), "memory": memory, "dimensions": search.space.options,
            "objective": job_plan.describe(), "job_plan": vars(job_plan),
            "peak_mem_measures": ("GPU memory allocated by torch tensors (peak)" if device.type == "cuda" else
                                  "the rise of the process's resident memory during the run (RSS peak - RSS at start)"),
            "load": {"min": round(min(loads), 2), "max": round(max(loads), 2), "cores": host["cores"],
                     "threads": host["threads"], "processes": host["processes"],
                     "oversubscribed": oversubscribed(host, max(loads))},
            "cost": dict(search.cost, search_s=round(search.elapsed(), 1),  # the job's time: its final prediction
                         **({"job_s": round(search.time(ref), 2)} if ref is not None and ref.measured else {})),
            "interrupted": bool(stopped), "stopped_by": signal_name(stopped) if stopped else None,
            "elapsed_s": round(search.elapsed(), 1), "rounds": search.rounds, "primed": search.primes,
            "rows": [row_dict(r, search) for r in search.rows],
            "decision": None if best_row is None else {
                "candidate": best.label(), "why": search.why if search.choice is not None else
                "the best so far (the search was stopped before its finals)",
                "reference": ref.candidate.label() if ref else None, "too_noisy": search.too_noisy},
            "best": None if best_row is None else {
                "overrides": best_row.overrides, "candidate": best.label(),
                "command": command(without(job, best_row.overrides), best_row.overrides, relaunch("looplib.train")),
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
    job_s = (result.get("cost") or {}).get("job_s")
    print(f"[tune] {len(result['rows'])} candidates in {result['elapsed_s']:.0f} s"
          + (f" ({result['elapsed_s'] / job_s:,.1f}x the job as given, predicted {job_s:,.1f} s)" if job_s else "")
          + f"; tune.json, tune.md, tune.png in {run_dir}", flush=True)
    load = result.get("load") or {}
    if load.get("oversubscribed"):
        print(f"[tune] measured on an oversubscribed machine ({load['oversubscribed']}; load {load['min']}-"
              f"{load['max']}): its times are slower and noisier than the job alone; the intervals in tune.md say "
              "how sure each verdict is", flush=True)
    decision = result.get("decision")
    if result.get("interrupted"):
        where = result.get("stopped_on_rank")
        print(f"[tune] stopped by {result['stopped_by']}" + (f" on rank {where}" if where is not None else "")
              + ": what was measured is in tune.json; the best so far (not confirmed by the finals):", flush=True)
    elif decision:
        best = result["best"]
        print(f"[tune] {decision['candidate']}: {decision['why']}"
              + (f" (predicted {best['job_s']:,.1f} s for the job)" if best.get("job_s") else ""), flush=True)
    if result["best"]:
        print(result["best"]["command"], flush=True)  # last: ready to paste
    else:
        print("[tune] no candidate was measured (see tune.md for each one's reason)", flush=True)
