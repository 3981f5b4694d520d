"""Sweep reports: ``python -m looplib.report <multirun dir> [--out DIR]``.

Reads every job directory under a ``python -m looplib.train -m ...`` sweep (the folders
holding ``.hydra/overrides.yaml``), takes each job's overrides and its final metrics from
``metrics.jsonl``, and writes ``report.md`` (a markdown table), ``report.csv`` and
``report.png`` (a bar chart of throughput, peak memory and loss per job) into the sweep
directory, or ``--out``. The overrides every job shares are printed once above the table;
the ones that vary become its first columns, so a sweep over precisions and optimizers
reads like the efficiency guides' tables. matplotlib is imported only to draw the chart
(``pip install 'looplib[report]'``; without it the table and CSV are still written).
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

METRICS = [  # column, header, how to format it
    ("steps", "steps", "{:d}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("eval_loss", "eval loss", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("samples_per_s", "samples/s", "{:,.2f}"),
    ("peak_mem_mb", "peak memory MB", "{:,.0f}"),
    ("skipped_steps", "skipped steps", "{:d}"),
]


@dataclass
class Job:
    name: str
    overrides: dict[str, str]
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    status: str = "ok"


def read_overrides(path: Path) -> dict[str, str]:
    """``.hydra/overrides.yaml`` is a YAML list of ``key=value`` strings (one per line, ``- ``)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("- "):
            item = line[2:].strip().strip("'\"")
            key, _, value = item.partition("=")
            out[key] = value
    return out


def summarise(rows: list[dict]) -> dict:
    """Final metrics of one run. Throughput is the median over logged intervals after the
    first (which pays for warm-up and, with +compile, compilation) when there are several."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    steady = train[1:] or train

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "steps": train[-1]["step"] if train else None,
        "final_loss": train[-1]["loss"] if train else None,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": median("tokens_per_s"),
        "samples_per_s": median("samples_per_s"),
        "peak_mem_mb": max((r.get("peak_mem_mb", 0) for r in train), default=None),
        "skipped_steps": train[-1].get("skipped_steps") if train else None,
    }


def collect(sweep: Path) -> list[Job]:
    jobs = []
    for overrides in sorted(Path(sweep).glob("**/.hydra/overrides.yaml"), key=job_order):
        job_dir = overrides.parent.parent
        job = Job(str(job_dir.relative_to(sweep)) or ".", read_overrides(overrides))
        metrics = job_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        if not rows:
            job.status = "no metrics (failed or still running)"
        else:
            job.metrics = summarise(rows)
        jobs.append(job)
    return jobs


def job_order(path: Path):
    parts = path.parent.parent.parts
    return [(0, int(p)) if p.isdigit() else (1, p) for p in parts]  # 2 before 10


def split_overrides(jobs: list[Job]) -> tuple[list[str], dict[str, str]]:
    """(keys whose value differs between jobs, overrides every job shares)."""
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    varying = [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]
    common = {k: jobs[0].overrides[k] for k in keys if k not in varying}
    return varying, common


def fmt(value, pattern: str) -> str:
    if value is None:
        return ""
    try:
        return pattern.format(value)
    except (ValueError, TypeError):
        return str(value)


def table(jobs: list[Job]) -> tuple[list[str], list[list[str]], list[list]]:
    """Header, formatted cells (markdown), raw cells (CSV)."""
    varying, _ = split_overrides(jobs)
    header = ["job", *varying, *(h for _, h, _ in METRICS), "status"]
    cells, raw = [], []
    for job in jobs:
        values = [job.metrics.get(k) for k, _, _ in METRICS]
        cells.append([job.name, *(job.overrides.get(k, "") for k in varying),
                      *(fmt(v, p) for v, (_, _, p) in zip(values, METRICS)), job.status])
        raw.append([job.name, *(job.overrides.get(k, "") for k in varying), *values, job.status])
    return header, cells, raw


def markdown(jobs: list[Job], sweep: Path) -> str:
    header, cells, _ = table(jobs)
    _, common = split_overrides(jobs)
    lines = [f"# Sweep report: {sweep}", ""]
    if common:
        lines += ["Every job: `" + " ".join(f"{k}={v}" for k, v in common.items()) + "`", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
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


def chart(jobs: list[Job], path: Path) -> None:
    """Three bar panels (tokens/s, peak memory, final loss), one bar per job. Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    varying, _ = split_overrides(jobs)
    labels = [label(job, varying) for job in jobs]
    panels = [("tokens_per_s", "tokens/s (higher is better)"), ("peak_mem_mb", "peak memory MB (lower is better)"),
              ("final_loss", "final loss")]
    width = max(6.0, 1.1 * len(jobs))
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 3.2 * len(panels)), constrained_layout=True)
    for ax, (key, title) in zip(axes, panels):
        values = [job.metrics.get(key) or 0 for job in jobs]
        bars = ax.bar(range(len(jobs)), values, color="tab:blue")
        ax.bar_label(bars, labels=[fmt(job.metrics.get(key), "{:,.3g}") for job in jobs], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(jobs)), labels, fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(sweep: str | Path, out: str | Path | None = None) -> dict[str, Path]:
    """Write report.md, report.csv and (with matplotlib) report.png; returns their paths."""
    sweep = Path(sweep)
    jobs = collect(sweep)
    if not jobs:
        raise FileNotFoundError(f"no job directories (with .hydra/overrides.yaml) under {sweep}")
    out = Path(out or sweep)
    out.mkdir(parents=True, exist_ok=True)
    written = {"md": out / "report.md", "csv": out / "report.csv"}
    written["md"].write_text(markdown(jobs, sweep))
    written["csv"].write_text(write_csv(jobs))
    try:
        chart(jobs, out / "report.png")
        written["png"] = out / "report.png"
    except ImportError:
        print("looplib.report: matplotlib is not installed, no chart (pip install 'looplib[report]')",
              file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m looplib.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help="a multirun directory, e.g. multirun/2026-01-01/12-00-00")
    parser.add_argument("--out", help="where to write report.md/.csv/.png (default: the sweep directory)")
    args = parser.parse_args(argv)
    try:
        written = report(args.sweep, args.out)
    except FileNotFoundError as err:
        print(f"looplib.report: error: {err}", file=sys.stderr)
        return 2
    print(written["md"].read_text(), end="")
    print("\nwritten: " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
