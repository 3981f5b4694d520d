"""What the search writes into its run directory: tune.json, tune.md, tune.png, and the best command.

``tune.md``: each candidate's predicted time to finish the job, as a multiple of the reference's
with its 95% interval and verdict, beside its steady throughput, one-off seconds, compile
seconds (warm and cold), the job length from which it pays off, and its peak memory (also as a
multiple of the reference's), the planner's figure and the loss difference; then where the
predicted time goes for the reference and the choice.
``tune.png`` draws throughput against measured peak memory, the Pareto front marked (no
candidate is both faster and smaller than a point on it); matplotlib only when installed.
"""
from __future__ import annotations

import json
import math
import shlex
import statistics
from pathlib import Path

from ..atomic import write_atomic
from .search import Row, Search

STATUS_ORDER = {"measured": 0, "diverged": 1, "oom": 2, "error": 3, "interrupted": 4, "pruned": 5, "skipped": 6}
PARTS = ("startup", "warmup", "steps", "evaluations", "checkpoints", "sample", "rest")


def rounded(value, digits=3):
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else round(value, digits)


def row_dict(row: Row, search: Search) -> dict:
    """One row of tune.json: the candidate, its predicted job time (and in parts), its interval
    against the reference, its throughput, memory and compile figures, and each run's timings."""
    o = row.outcome
    speeds = [s for run in row.runs for s in run.repeats]
    first = row.runs[0].timing if row.runs and row.runs[0].timing else None
    times = search.times(row) if row.measured else []
    pays = search.pays_off_after(row)
    return {"candidate": row.candidate.label(), "stage": row.stage, "overrides": row.overrides,
            "status": row.status, "reason": row.reason,
            "job_s": rounded(search.time(row), 2) if times else None, "job_s_runs": [round(t, 2) for t in times],
            "vs_reference": row.vs_reference.to_dict() if row.vs_reference else None, "verdict": row.verdict,
            "parts_s": {k: round(v, 2) for k, v in search.parts(row).items()} if times else None,
            "step_s": rounded(search.step_s(row), 5) if times else None,
            "samples_per_s": statistics.median(speeds) if speeds else (o.samples_per_s if o else None),
            "spread": (max(speeds) - min(speeds)) / statistics.median(speeds) if speeds else None,
            "samples_per_s_repeats": [round(s, 3) for s in speeds],
            "tokens_per_s": o.tokens_per_s if o else None, "peak_mem_mb": o.peak_mem_mb if o else None,
            "planned_mem_mb": row.planned_mem_mb,
            "compile_s": first.compile_s if first else None, "compiles": first.compiles if first else None,
            "recompiled_at": first.recompiled_at if first else [],
            "compile_s_cold": row.primed.compile_s if row.primed else None,
            "pays_off_after_steps": rounded(pays, 0), "pays_off": pays_off_text(pays),
            "loss": o.loss if o else None, "loss_delta": row.loss_delta,
            "wall_s": round(sum(r.wall_s for r in row.runs), 1) if row.runs else (round(o.wall_s, 1) if o else None),
            "noisy": row.noisy,
            "runs": [dict(r.timing.to_dict(), wall_s=round(r.wall_s, 2), spread=rounded(r.spread)) for r in row.runs
                     if r.timing]
            + [dict(r.timing.to_dict(), wall_s=round(r.wall_s, 2), spread=rounded(r.spread),
                    set_aside="noisy: measured again, and the new run was not") for r in row.set_aside if r.timing]}


def noise_note(r: dict) -> str:
    aside = [x for x in r.get("runs", []) if x.get("set_aside")]
    if r.get("noisy"):
        return "noisy: a run and its repeat both spread beyond tune.max_spread. "
    return f"{len(aside)} noisy run(s) measured again and set aside. " if aside else ""


def pays_off_text(steps: float | None) -> str:
    if steps is None:
        return ""
    if math.isinf(steps):
        return "never: its steps are not faster"
    return "at once" if steps == 0 else f"after {steps:,.0f} steps"


def command(job: list[str], overrides: list[str], start: str = "python -m looplib.train") -> str:
    """The command line a user pastes: ``start`` (``python -m looplib.train``, or under torchrun
    ``torchrun --nproc_per_node N -m looplib.train``: ``looplib.process.launcher.relaunch``) with the overrides."""
    return " ".join([start, *map(shlex.quote, [*job, *overrides])])


def write(run_dir: Path, result: dict) -> None:
    """tune.json (the result as it is), tune.md and tune.png beside it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "tune.json", json.dumps(result, indent=1) + "\n")
    write_atomic(run_dir / "tune.md", markdown(result))
    chart(run_dir / "tune.png", result)


def mb(value) -> str:
    return "-" if value is None else f"{value:,.1f}" if abs(value) < 10 else f"{value:,.0f}"


def multiple(value, base) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def seconds(value) -> str:
    return "-" if value is None else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def interval(r: dict) -> str:
    v = r.get("vs_reference")
    if not v:
        return "1.00x (reference)" if r.get("verdict") == "reference" else "-"
    if v["low"] is None:
        return f"{v['ratio']:.2f}x (1 run)"
    return f"{v['ratio']:.2f}x [{v['low']:.2f}-{v['high']:.2f}] ({v['runs']}/{v['reference_runs']} runs)"


def markdown(result: dict) -> str:
    rows = result["rows"]
    ref = next((r for r in rows if r.get("verdict") == "reference"), None) or next(
        (r for r in rows if r["samples_per_s"]), {})
    base_mem = ref.get("peak_mem_mb")
    load = result.get("load") or {}
    lines = [f"# looplib.tune: {result['device']}", "",
             f"The job: `{command(result['job'], [], result.get('train_with', 'python -m looplib.train'))}`", "",
             f"**Objective**: the seconds to finish this job ({result.get('objective', '?')}), predicted for each "
             "candidate from its own runs: startup + compile and warm-up + steps x step time + evaluations + "
             "checkpoint saves + the sample + the rest (export, exit). "
             f"Each run: {result['tune']['steps']} warm-up steps, then {result['tune']['repeats']} timed intervals of "
             f"{result['tune']['steps']} steps. The leaders and the reference were measured again in "
             f"{result.get('rounds', 0)} interleaved round(s); `vs reference` is the ratio of predicted job times with "
             "its 95% interval (Welch's t on the runs' log times).",
             f"Memory: {result['memory']}. Peak memory measures {result.get('peak_mem_measures', 'the peak')}.",
             f"Machine load (1-minute load average) during the search: {load.get('min', '-')} to {load.get('max', '-')} "
             f"on {load.get('cores', '-')} cores" + (f"; each run used {load['threads']} thread(s), "
                                                      f"{load.get('processes', 1)} process(es) on this host"
                                                      if load.get("threads") else "") + "."]
    if load.get("oversubscribed"):
        lines += [f"**Oversubscribed** ({load['oversubscribed']}): the runs competed for cores, so every time here is "
                  "slower and noisier than the job alone would run; OMP_NUM_THREADS to fit the cores, or a quieter "
                  "machine, measures closer."]
    cost = result.get("cost") or {}
    if cost.get("job_s") and cost.get("search_s"):
        lines += [f"The search took {cost['search_s']:,.0f} s, {cost['search_s'] / cost['job_s']:,.1f}x the job as given "
                  f"(predicted {cost['job_s']:,.1f} s); it planned about {cost.get('runs_likely', '?')} runs of "
                  f"{cost.get('run_s') or 0:,.1f} s."]
    lines.append("")
    decision = result.get("decision") or {}
    if decision.get("why"):
        lines += [f"**Choice**: {decision.get('candidate', '-')}: {decision['why']}.", ""]
    steps = (result.get("job_plan") or {}).get("max_steps")
    later = [r for r in rows if r.get("pays_off_after_steps") and steps and r["pays_off_after_steps"] > steps]
    if later:
        lines += ["Faster per step, but not for a job this short: " + "; ".join(
            f"{r['candidate']} pays for its one-off costs after {r['pays_off_after_steps']:,.0f} steps" for r in later)
            + f" (this job: {steps:,} steps).", ""]
    if result.get("primed"):
        lines += ["Paid before the first timed run (untimed): " + "; ".join(
            f"{p['candidate']} ({p.get('what') or 'the compile cache'}: {p['wall_s']:.0f} s"
            + (f", compile {p['compile_s']:.1f} s cold" if p.get("compile_s") else "") + ")"
            for p in result["primed"]) + ".", ""]
    lines += ["| candidate | status | job s | vs reference [95%] | verdict | samples/s | step ms | one-off s | "
              "compile s (cold) | pays off | peak MB | memory | planned MB | loss delta | reason |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (STATUS_ORDER.get(r["status"], 9), r["job_s"] or math.inf)):
        parts = r.get("parts_s") or {}
        one_off = sum(v for k, v in parts.items() if k != "steps") if parts else None
        compile_text = "-" if r.get("compile_s") is None else (
            f"{r['compile_s']:.1f}" + (f" ({r['compile_s_cold']:.1f})" if r.get("compile_s_cold") else "")
            + (f", {r['compiles']} graphs" if r.get("compiles") else ""))
        lines.append("| " + " | ".join([
            r["candidate"], r["status"], seconds(r.get("job_s")), interval(r), r.get("verdict") or "-",
            f"{r['samples_per_s']:,.2f}" if r["samples_per_s"] else "-",
            f"{r['step_s'] * 1000:,.1f}" if r.get("step_s") else "-", seconds(one_off), compile_text,
            r.get("pays_off") or "-", mb(r["peak_mem_mb"]), multiple(r["peak_mem_mb"], base_mem),
            mb(r["planned_mem_mb"]), f"{r['loss_delta']:+.2g}" if r["loss_delta"] is not None else "-",
            noise_note(r) + r["reason"].replace("|", "/")]) + " |")
    shown = [r for r in rows if r.get("parts_s") and (r.get("verdict") == "reference"
                                                      or r["candidate"] == decision.get("candidate"))]
    if shown:
        lines += ["", "Where the predicted time goes (seconds):", "",
                  "| candidate | " + " | ".join(PARTS) + " | job |", "|---|" + "---|" * (len(PARTS) + 1)]
        for r in shown:
            lines.append(f"| {r['candidate']} | " + " | ".join(seconds(r["parts_s"][k]) for k in PARTS)
                         + f" | {seconds(r['job_s'])} |")
    best = result.get("best")
    if result.get("interrupted"):
        lines += ["", f"Stopped by {result.get('stopped_by', 'a signal')}: the rows above are what was measured; "
                  "the best so far has not been confirmed by the finals."]
    lines += ["", f"Best: `{best['command']}`" if best else "No candidate was measured.", ""]
    return "\n".join(lines)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(memory, speed) points no other point beats on both (less memory and more speed)."""
    front, fastest = [], -1.0
    for mem, speed in sorted(points, key=lambda p: (p[0], -p[1])):
        if speed > fastest:
            front.append((mem, speed))
            fastest = speed
    return front


def chart(path: Path, result: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    measured = [r for r in result["rows"] if r["status"] == "measured" and r["peak_mem_mb"] is not None
                and r["samples_per_s"]]
    if not measured:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([r["peak_mem_mb"] for r in measured], [r["samples_per_s"] for r in measured], color="tab:blue")
    for r in measured:
        ax.annotate(r["candidate"], (r["peak_mem_mb"], r["samples_per_s"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    front = pareto([(r["peak_mem_mb"], r["samples_per_s"]) for r in measured])
    ax.plot([m for m, _ in front], [s for _, s in front], color="tab:red", marker="o", label="Pareto front")
    ax.set_xlabel(f"peak memory, MB ({result.get('peak_mem_measures', 'measured')[:60]})")
    ax.set_ylabel("samples/s (median)")
    ax.set_title(f"looplib.tune on {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
