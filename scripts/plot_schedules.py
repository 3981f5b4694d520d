"""Every learning-rate schedule's shape, as docs/command-line.md shows it (docs/schedules.png).

    python scripts/plot_schedules.py [--out docs/schedules.png] [--steps 300]

Each panel is one option of conf/schedule/ at its defaults (wsd: once per cool-down shape), the
factor ``looplib.schedule`` multiplies the lr by at every step of a ``--steps``-step run, computed by
the classes themselves (matplotlib: pip install 'looplib[bench]').
"""
from __future__ import annotations

import argparse
from pathlib import Path

from looplib.schedule import WSD, Linear, Schedule, WarmupCosine


def shapes() -> dict:
    """The schedules drawn: one per option, wsd once per cool-down shape."""
    return {"+schedule=constant": Schedule(), "+schedule=cosine": WarmupCosine(), "+schedule=linear": Linear(),
            **{f"+schedule=wsd schedule.decay_shape={shape}": WSD(decay_shape=shape)
               for shape in ("linear", "cosine", "1-sqrt")}}


def plot(out: Path, steps: int = 300) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    drawn = shapes()
    fig, axes = plt.subplots(2, 3, figsize=(11, 5.5), sharex=True, sharey=True)
    for ax, (name, schedule) in zip(axes.flat, drawn.items()):
        ax.plot(range(1, steps + 1), [schedule.factor(s, steps) for s in range(steps)], color="tab:blue")
        ax.set_title(name, fontsize=9)
        ax.set_ylim(-0.03, 1.05)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel(f"optimizer step (max_steps={steps})")
    for ax in axes[:, 0]:
        ax.set_ylabel("lr / optim.lr")
    fig.suptitle("The schedules at their defaults (warm-up 25 steps; wsd: cool-down over the last 20%)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/schedules.png")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(plot(Path(args.out), args.steps))
