"""Reports: ``python -m looplib.report <multirun dir or run dir> [--out DIR]``.

A single run's directory gets its loss curve, ``loss.png`` (training and held-out loss
against step); every run that finishes writes it too when matplotlib is installed (set
``LOOPLIB_PLOT=0`` to skip it). A sweep gets the table and chart below.

Reads every job directory under a ``python -m looplib.train -m ...`` sweep (the folders holding
the command line's record of the job's overrides: ``looplib.cli.record``), takes each job's overrides and its final metrics from
``metrics.jsonl``, and writes ``report.md`` (a markdown table), ``report.csv`` and
``report.png`` (a bar chart of throughput, peak memory and loss per job) into the sweep
directory, or ``--out``. The overrides every job shares are printed once above the table;
the ones that vary become its first columns, so a sweep over precisions and optimizers
reads like the efficiency guides' tables. matplotlib is imported only to draw the chart
(``pip install 'looplib[report]'``; without it the table and CSV are still written).

Throughput is the median over the job's logged intervals after the first, with the lowest
and highest beside it, so noise is visible. Peak memory is the job's own (looplib resets
the peaks when a job starts; the first metrics row says what the figure measures, and the
report repeats it). The chart draws each figure as a point with its range on an axis that
starts near the data, and a panel of training and held-out loss against step for every job.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..cli import record
from ..errors import EXIT_CONFIG
from .study import fmt
from ..run.plots import loss_curve  # noqa: F401 (python -m looplib.report RUN_DIR draws it)

METRICS = [  # column, header, how to format it
    ("steps", "steps", "{:d}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("eval_loss", "eval loss", "{:.4f}"),
    ("eval_accuracy", "eval accuracy", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("tokens_per_s_min", "tokens/s min", "{:,.0f}"),
    ("tokens_per_s_max", "tokens/s max", "{:,.0f}"),
    ("sequences_per_s", "sequences/s", "{:,.1f}"),  # classification runs count sequences, not tokens
    ("sequences_per_s_min", "sequences/s min", "{:,.1f}"),
    ("sequences_per_s_max", "sequences/s max", "{:,.1f}"),
    ("samples_per_s", "samples/s", "{:,.2f}"),
    ("peak_mem_mb", "peak memory MB", "{:,.0f}"),
    ("mem_rise_mb", "rise in job MB", "{:,.1f}"),
    ("skipped_steps", "skipped steps", "{:d}"),
]


@dataclass
class Job:
    name: str
    overrides: dict[str, str]
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    status: str = "ok"
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # loss / eval_loss against step
    memory: str | None = None  # what peak_mem_mb measures, from the job's first row
    launch: tuple = ()         # (processes, launcher, global batch) from its first row (its latest run's)


def summarise(rows: list[dict]) -> dict:
    """Final metrics of one run. Throughput is the median over logged intervals after the
    first (which pays for warm-up and, with +compile, compilation) when there are several,
    with the lowest and highest of the same intervals."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    accuracy = [r for r in rows if "eval_accuracy" in r]
    steady = train[1:] or train

    def values(key):
        return [r[key] for r in steady if r.get(key) is not None]

    def median(key):
        return statistics.median(values(key)) if values(key) else None

    peak = max((r.get("peak_mem_mb", 0) for r in train), default=None)
    start = next((r["mem_at_start_mb"] for r in train if "mem_at_start_mb" in r), None)

    return {
        "steps": train[-1]["step"] if train else None,
        "final_loss": train[-1]["loss"] if train else None,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_accuracy": accuracy[-1]["eval_accuracy"] if accuracy else None,
        **{f"{unit}_per_s{end}": f(f"{unit}_per_s") for unit in ("tokens", "sequences")
           for end, f in (("", median), ("_min", lambda k: min(values(k), default=None)),
                          ("_max", lambda k: max(values(k), default=None)))},
        "samples_per_s": median("samples_per_s"),
        "peak_mem_mb": peak,
        "mem_rise_mb": peak - start if peak is not None and start is not None else None,
        "skipped_steps": train[-1].get("skipped_steps") if train else None,
    }


def collect(sweep: Path) -> list[Job]:
    jobs = []
    for job_dir, overrides in sorted(record.jobs(Path(sweep)), key=job_order):
        job = Job(str(job_dir.relative_to(sweep)) or ".", record.read_overrides(overrides))
        metrics = job_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        if not rows:
            job.status = "no metrics (failed or still running)"
        else:
            job.metrics = summarise(rows)
            job.curves = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in ("loss", "eval_loss")}
            job.memory = next((r["peak_mem_measures"] for r in rows if "peak_mem_measures" in r), None)
            job.launch = next(((r["world_size"], r.get("launcher"), r.get("global_batch")) for r in reversed(rows)
                               if "world_size" in r), ())
            pruned = next((r["step"] for r in rows if r.get("pruned")), None)
            if pruned is not None:  # stopped by the study's pruner (looplib.cli.sweep): not a finished job
                job.status = f"pruned at step {pruned}"
        jobs.append(job)
    return jobs


def job_order(found: tuple[Path, Path]):
    parts = found[0].parts
    return [(0, int(p)) if p.isdigit() else (1, p) for p in parts]  # 2 before 10


def split_overrides(jobs: list[Job]) -> tuple[list[str], dict[str, str]]:
    """(keys whose value differs between jobs, overrides every job shares)."""
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    varying = [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]
    common = {k: jobs[0].overrides[k] for k in keys if k not in varying}
    return varying, common


def shown(jobs: list[Job]) -> list[tuple[str, str, str]]:
    """The metric columns some job has a value for (no accuracy column in a language-model sweep)."""
    return [m for m in METRICS if any(job.metrics.get(m[0]) is not None for job in jobs)] or METRICS


def launches(jobs: list[Job]) -> set[tuple]:
    """The (processes, launcher, global batch) the jobs recorded (none: written before looplib recorded it)."""
    return {job.launch for job in jobs if job.launch}


def launch_text(launch: tuple) -> str:
    n, who, batch = launch
    return f"{n} process{'es' if n != 1 else ''} ({who})" + (f", global batch {batch}" if batch is not None else "")


def table(jobs: list[Job]) -> tuple[list[str], list[list[str]], list[list]]:
    """Header, formatted cells (markdown), raw cells (CSV). Jobs run on different process counts or
    global batches get a column for each: their figures are not of the same training."""
    varying, _ = split_overrides(jobs)
    columns = shown(jobs)
    geometry = len(launches(jobs)) > 1
    header = ["job", *varying, *(["processes", "global batch"] if geometry else []), *(h for _, h, _ in columns),
              "status"]
    cells, raw = [], []
    for job in jobs:
        values = [job.metrics.get(k) for k, _, _ in columns]
        where = [job.launch[0], job.launch[2]] if job.launch else [None, None]
        where = where if geometry else []
        cells.append([job.name, *(job.overrides.get(k, "") for k in varying), *(fmt(v, "{}") for v in where),
                      *(fmt(v, p) for v, (_, _, p) in zip(values, columns)), job.status])
        raw.append([job.name, *(job.overrides.get(k, "") for k in varying), *where, *values, job.status])
    return header, cells, raw


def markdown(jobs: list[Job], sweep: Path) -> str:
    header, cells, _ = table(jobs)
    _, common = split_overrides(jobs)
    lines = [f"# Sweep report: {sweep}", ""]
    if common:
        lines += ["Every job: `" + " ".join(f"{k}={v}" for k, v in common.items()) + "`", ""]
    if len(launches(jobs)) == 1:
        lines += [f"Every job ran on {launch_text(next(iter(launches(jobs))))}.", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    unit = "tokens" if any(job.metrics.get("tokens_per_s") is not None for job in jobs) else "sequences"
    lines += ["", f"{unit}/s: the median over each job's logged intervals after the first (warm-up); "
              "min and max: the lowest and highest of the same intervals."]
    measures: dict[str, list[str]] = {}
    for job in jobs:
        if job.metrics:
            measures.setdefault(job.memory or "not recorded (metrics written before looplib said what it "
                                "measures: possibly the process's peak, rising in job order)", []).append(job.name)
    for text, names in measures.items():
        who = "every job" if len(measures) == 1 else "jobs " + ", ".join(names)
        lines.append(f"peak memory MB ({who}): {text}.")
    if any(job.metrics.get("mem_rise_mb") is not None for job in jobs):
        lines.append("rise in job MB: the peak minus the same measure when the job's training began (after "
                     "its model was built): what its training and evaluation added.")
    return "\n".join(lines) + "\n"


def write_csv(jobs: list[Job]) -> str:
    header, _, raw = table(jobs)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(["" if v is None else v for v in row] for row in raw)
    return buf.getvalue()


def label(job: Job, varying: list[str]) -> str:
    return "\n".join(f"{k.lstrip('+')}={job.overrides.get(k, '')}" for k in varying) or job.name


def chart(jobs: list[Job], path: Path) -> dict:
    """One point per job for throughput (with its min-max range), peak memory, final losses and,
    in classification sweeps, accuracy, on axes that start near the data; below them the loss
    curves (training solid, held-out dashed) of every job against step. Agg backend. Returns
    what it drew: each panel's y limits by metric, and the curves' labels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    varying, _ = split_overrides(jobs)
    labels = [label(job, varying) for job in jobs]
    if len(set(labels)) < len(labels):  # the same overrides twice (a repeat): the job's folder tells them apart
        labels = [f"{job.name}: {text}" for job, text in zip(jobs, labels)]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(jobs))]
    unit = "tokens" if any(job.metrics.get("tokens_per_s") is not None for job in jobs) else "sequences"
    panels = [(f"{unit}_per_s", f"{unit}/s: median, min-max (higher is better)"),
              ("peak_mem_mb", "peak memory MB, this job's own (lower is better)"),
              ("final_loss", "final loss: training o, held-out x")]
    if any(job.metrics.get("eval_accuracy") is not None for job in jobs):
        panels.append(("eval_accuracy", "held-out accuracy (higher is better)"))
    width = max(8.0, 1.0 * len(jobs) + 3)
    fig = plt.figure(figsize=(width, 3.0 * len(panels) + 4.5), constrained_layout=True)
    grid = fig.add_gridspec(len(panels) + 2, 1)
    ticks = FuncFormatter(lambda v, _: plain(v, tick=True))  # 6.21, 1250: no offsets, no scientific notation
    x = list(range(len(jobs)))
    drawn: dict = {"ylim": {}, "curves": []}
    for row, (key, title) in enumerate(panels):
        ax = fig.add_subplot(grid[row, 0])
        points = [(i, job.metrics.get(key)) for i, job in enumerate(jobs) if job.metrics.get(key) is not None]
        for i, value in points:
            ax.plot(i, value, "o", color=colors[i], markersize=7)
            ax.annotate(plain(value), (i, value), textcoords="offset points", xytext=(8, 0),
                        va="center", fontsize=8)
        spread = list(points)
        if key == f"{unit}_per_s":  # the range over the job's logged intervals
            for i, job in enumerate(jobs):
                lo, hi = job.metrics.get(f"{key}_min"), job.metrics.get(f"{key}_max")
                if lo is not None and hi is not None:
                    ax.vlines(i, lo, hi, color=colors[i], linewidth=2, alpha=0.6)
                    spread += [(i, lo), (i, hi)]
        if key == "final_loss":
            for i, job in enumerate(jobs):
                if job.metrics.get("eval_loss") is not None:
                    ax.plot(i, job.metrics["eval_loss"], "x", color=colors[i], markersize=8)
                    spread.append((i, job.metrics["eval_loss"]))
        near_data(ax, [v for _, v in spread])
        ax.yaxis.set_major_formatter(ticks)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlim(-0.5, len(jobs) - 0.5)
        ax.grid(axis="y", alpha=0.3)
        drawn["ylim"][key] = ax.get_ylim()
    ax = fig.add_subplot(grid[len(panels):, 0])
    for i, job in enumerate(jobs):
        name = labels[i].replace("\n", " ")
        if job.curves.get("loss"):
            ax.plot(*zip(*job.curves["loss"]), "-", color=colors[i], label=f"{name} (training)")
        if job.curves.get("eval_loss"):
            ax.plot(*zip(*job.curves["eval_loss"]), "--o", color=colors[i], markersize=4, label=f"{name} (held-out)")
    ax.set_title("loss against step: training solid, held-out dashed", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(ticks)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, ncol=2 if len(jobs) > 4 else 1, loc="best")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    drawn["curves"] = [line.get_label() for line in ax.lines]
    return drawn


def plain(value: float, tick: bool = False) -> str:
    """Numbers as people write them: 12250 and 470 (no 1.225e+04; no thousands comma, which small
    chart type makes look like a decimal point), 6.2655, 0.75."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    if tick:
        return f"{value:.6g}"
    return f"{value:.4f}" if abs(value) >= 1 else f"{value:.4g}"


def near_data(ax, values: list[float]) -> None:
    """A y axis that starts near the data, not at zero: 6.21 and 6.36 must look different."""
    if not values:
        return
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.15 or abs(hi) * 0.05 or 1.0
    ax.set_ylim(max(lo - pad, 0) if lo >= 0 else lo - pad, hi + pad)  # never below zero for counts


def report(sweep: str | Path, out: str | Path | None = None) -> dict[str, Path]:
    """Write report.md, report.csv and (with matplotlib) report.png; returns their paths."""
    sweep = Path(sweep)
    if not sweep.is_dir():
        raise FileNotFoundError(f"{sweep} is not a directory; give a sweep's directory (multirun/<date>/<time>) "
                                "or one run's (outputs/<date>/<time>)")
    jobs = collect(sweep)
    if not jobs:
        raise FileNotFoundError(f"no job directories (with {record.RECORD}/{record.OVERRIDES}) under {sweep}")
    out = Path(out or sweep)
    out.mkdir(parents=True, exist_ok=True)
    written = {"md": out / "report.md", "csv": out / "report.csv"}
    from .study import study_section
    text, plots = study_section(sweep, out)  # hydra/sweeper=optuna: the study behind the jobs
    written["md"].write_text(markdown(jobs, sweep) + text)
    written["csv"].write_text(write_csv(jobs))
    single = (sweep / "metrics.jsonl").exists()  # one run's directory: its loss curve
    written.update(plots)
    try:
        if single:
            written["png"] = loss_curve(sweep, out)
        else:
            chart(jobs, out / "report.png")
            written["png"] = out / "report.png"
    except ImportError:
        print("looplib.report: matplotlib is not installed, no chart (pip install 'looplib[report]')",
              file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m looplib.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep", metavar="DIR", help="a multirun directory, e.g. multirun/2026-01-01/12-00-00, or one run's "
                        "directory (outputs/2026-01-01/12-00-00: its loss curve, loss.png)")
    parser.add_argument("--out", help="where to write report.md/.csv/.png (default: the sweep or run directory)")
    args = parser.parse_args(argv)
    try:
        written = report(args.sweep, args.out)
    except FileNotFoundError as err:
        print(f"looplib.report: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(written["md"].read_text(), end="")
    print("\nwritten: " + ", ".join(str(p) for p in written.values()))
    return 0

