"""A run's own chart: ``loss.png`` (training and held-out loss against step), drawn at the end of
every run when matplotlib is installed, and by ``python -m looplib.report RUN_DIR``."""
from __future__ import annotations

import json
from pathlib import Path


def loss_curve(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """``loss.png``: one run's training loss (solid) and held-out loss (dashed, points) against
    step, from its ``metrics.jsonl``. Needs matplotlib (ImportError without it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for key, style, name in (("loss", "-", "training"), ("eval_loss", "--o", "held-out")):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
        if points:
            ax.plot(*zip(*points), style, markersize=4, label=f"{name} loss")
    ax.set_title(f"loss against step: {run_dir.name}", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    path = Path(out or run_dir) / "loss.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def end_of_run_plot(run_dir: Path) -> Path | None:
    """``loss.png`` at the end of a run, when matplotlib is installed and ``LOOPLIB_PLOT`` is not
    0; a chart that cannot be drawn never fails the run (a warning says why)."""
    import importlib.util
    import logging
    import os
    if os.environ.get("LOOPLIB_PLOT", "1") == "0" or importlib.util.find_spec("matplotlib") is None:
        return None
    try:
        return loss_curve(run_dir)
    except Exception as err:  # noqa: BLE001 - the run's results are written; the chart is a courtesy
        logging.getLogger("looplib").warning("no loss.png (%s: %s)", type(err).__name__, err)
        return None
