"""The study section of ``python -m looplib.report`` for a ``hydra/sweeper=optuna`` sweep: its
trials with state and objective, the best trial's command line, and Optuna's optimisation
history and parameter importances as PNGs (Optuna imported only for such a sweep)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path



def fmt(value, pattern: str) -> str:
    if value is None:
        return ""
    try:
        return pattern.format(value)
    except (ValueError, TypeError):
        return str(value)


def where_run(geometry: dict | None) -> str:
    """``; run on 2 processes (torchrun --nproc_per_node 2), global batch 8``: what the study's trials
    were trained on (a study continues only on the same; recorded since looplib recorded it)."""
    if not geometry:
        return ""
    n = geometry.get("world_size")
    text = f"; run on {n} process{'es' if n != 1 else ''} ({geometry.get('launcher')})"
    return text + (f", global batch {geometry['global_batch']}" if geometry.get("global_batch") is not None else "")


def find_study(sweep: Path) -> tuple[str, str] | None:
    """(storage, study name) of a ``hydra/sweeper=optuna`` sweep directory, or None."""
    results = sweep / "optimization_results.yaml"
    if results.exists():
        import yaml
        found = yaml.safe_load(results.read_text()) or {}
        if isinstance(found, dict) and found.get("storage") and found.get("study_name"):
            return str(found["storage"]), str(found["study_name"])
    if (sweep / "study.db").exists():
        return f"sqlite:///{(sweep / 'study.db').absolute()}", ""
    return None


def study_section(sweep: Path, out: Path) -> tuple[str, dict[str, Path]]:
    """The study of an Optuna sweep: its trials (state, objective, parameters), the best
    trial's command line, and Optuna's optimisation-history and parameter-importance plots."""
    where = find_study(sweep)
    if where is None:
        return "", {}
    try:
        import optuna
    except ImportError:
        return "\n## Study\n\nThis sweep keeps an Optuna study: pip install 'looplib[optuna]' to report it.\n", {}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, name = where
    name = name or optuna.study.get_all_study_names(storage)[0]
    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    about = study.user_attrs.get("looplib_sweep", {})
    metric = about.get("metric", "value")
    params = list(dict.fromkeys(p for t in trials for p in t.params))
    where = {t.number: where_run(t.user_attrs.get("geometry")).removeprefix("; run on ") for t in trials}
    mixed = len(set(where.values())) > 1  # hydra.sweeper.allow_geometry_change=true: said for each trial
    counts = Counter(t.state.name.lower() for t in trials)
    lines = ["", f"## Study `{name}`", "",
             f"{study.direction.name.lower()} {metric}; {len(trials)} trials: "
             + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) + f" (storage {storage})"
             + where_run(study.user_attrs.get("looplib_geometry")), "",
             "| trial | state | " + " | ".join([metric, *params, *(["run on"] if mixed else []), "seconds"]) + " |",
             "|" + "|".join("---" for _ in range(len(params) + 4 + mixed)) + "|"]
    for t in trials:
        value = t.value if t.value is not None else (t.intermediate_values[max(t.intermediate_values)]
                                                      if t.intermediate_values else None)
        seconds = t.duration.total_seconds() if t.duration else None
        state = t.state.name.lower() + (" (interrupted)" if t.user_attrs.get("interrupted") else "")
        lines.append("| " + " | ".join([str(t.number), state, fmt(value, "{:.6g}"),
                                        *(fmt(t.params.get(p), "{:.4g}") for p in params),
                                        *([where[t.number] or "-"] if mixed else []), fmt(seconds, "{:.1f}")]) + " |")
    lines.append("")
    lines.append(f"{metric} of a pruned trial: its last evaluation before it was stopped.")
    try:
        best = study.best_trial
    except ValueError:
        best = None
    if best is not None:  # the command the sweeper recorded names its launcher: the trial's global batch
        import shlex
        cmd = best.user_attrs.get("command") or " ".join(
            ["python -m looplib.train", *(shlex.quote(o) for o in best.user_attrs.get("overrides", []))])
        lines += ["", f"Best: trial {best.number}, {metric} {best.value:.6g}. Run it again on its own with:", "",
                  f"    {cmd}"]
    plots: dict[str, Path] = {}
    try:
        import matplotlib
        matplotlib.use("Agg")
        import warnings
        from optuna.visualization import matplotlib as plot
        for key, draw, title in (("history", plot.plot_optimization_history, "optimisation history"),
                                 ("importances", plot.plot_param_importances, "parameter importances")):
            path = out / f"study_{key}.png"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    axes = draw(study)
                axes.figure.savefig(path, dpi=100, bbox_inches="tight")
                matplotlib.pyplot.close(axes.figure)
            except (ValueError, RuntimeError, ZeroDivisionError) as err:  # e.g. importances of one trial
                lines += ["", f"No {title} plot: {err}"]
                continue
            plots[f"study_{key}"] = path
            lines += ["", f"![{title}]({path.name})"]
    except ImportError:
        lines += ["", "No plots: matplotlib is not installed (pip install 'looplib[report]')"]
    return "\n".join(lines) + "\n", plots
