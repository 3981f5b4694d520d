"""What the search writes into its run directory: tune.json, tune.md, tune.png, and the best command.

``tune.md`` reads like the guides' tables: each candidate's speed and peak memory as multiples
of the job as given (``1.00x``), with the planner's figure and the loss difference beside them.
``tune.png`` draws throughput against measured peak memory, the Pareto front marked (no
candidate is both faster and smaller than a point on it); matplotlib only when installed.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..atomic import write_atomic
from .search import Row

STATUS_ORDER = {"measured": 0, "diverged": 1, "oom": 2, "error": 3, "pruned": 4, "skipped": 5}


def row_dict(row: Row) -> dict:
    o = row.outcome
    return {"candidate": row.candidate.label(), "stage": row.stage, "overrides": row.overrides,
            "status": row.status, "reason": row.reason,
            "samples_per_s": o.samples_per_s if o else None, "spread": o.spread if o else None,
            "samples_per_s_repeats": o.repeats if o else [],
            "tokens_per_s": o.tokens_per_s if o else None, "peak_mem_mb": o.peak_mem_mb if o else None,
            "planned_mem_mb": row.planned_mem_mb, "compile_s": o.compile_s if o else None,
            "loss": o.loss if o else None, "loss_delta": row.loss_delta, "wall_s": round(o.wall_s, 1) if o else None}


def command(job: list[str], overrides: list[str], launcher: str = "python") -> str:
    """The command line a user pastes: ``python -m looplib.train`` (or torchrun's) with the overrides."""
    return " ".join([launcher, "-m", "looplib.train", *map(shlex.quote, [*job, *overrides])])


def write(run_dir: Path, result: dict) -> None:
    """tune.json (the result as it is), tune.md and tune.png beside it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "tune.json", json.dumps(result, indent=1) + "\n")
    (run_dir / "tune.md").write_text(markdown(result))
    chart(run_dir / "tune.png", result)


def mb(value) -> str:
    return "-" if value is None else f"{value:,.1f}" if abs(value) < 10 else f"{value:,.0f}"


def multiple(value, base) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def markdown(result: dict) -> str:
    rows = result["rows"]
    ref = next((r for r in rows if r["samples_per_s"]), {})  # the job as given, or the first row that ran
    base_speed, base_mem = ref.get("samples_per_s"), ref.get("peak_mem_mb")
    lines = [f"# looplib.tune: {result['device']}", "",
             f"The job: `{command(result['job'], [])}`", "",
             f"Memory: {result['memory']}. Peak memory measures {result.get('peak_mem_measures', 'the peak')}.",
             f"Speed and memory are multiples of `{ref.get('candidate', '-')}` (the job as given when it ran); "
             "samples/s is the median of "
             f"{result['tune']['repeats']} timed repeats of {result['tune']['steps']} steps, spread = (max - min) / median.",
             "", "| candidate | status | samples/s | spread | speed | peak MB | memory | planned MB | compile s | "
             "loss delta | reason |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (STATUS_ORDER.get(r["status"], 9), -(r["samples_per_s"] or 0))):
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["candidate"], r["status"], f"{r['samples_per_s']:,.2f}" if r["samples_per_s"] else "-",
            f"{r['spread']:.0%}" if r["spread"] is not None else "-", multiple(r["samples_per_s"], base_speed),
            mb(r["peak_mem_mb"]), multiple(r["peak_mem_mb"], base_mem),
            mb(r["planned_mem_mb"]),
            f"{r['compile_s']:.1f}" if r["compile_s"] else "-",
            f"{r['loss_delta']:+.2g}" if r["loss_delta"] is not None else "-", r["reason"].replace("|", "/")))
    best = result.get("best")
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
    measured = [r for r in result["rows"] if r["status"] == "measured" and r["peak_mem_mb"] is not None]
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
