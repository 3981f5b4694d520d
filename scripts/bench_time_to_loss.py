"""How many steps, and how many seconds, does a job take to reach a loss? Muon and warm-up-stable-decay
against AdamW and cosine.

    python scripts/bench_time_to_loss.py --out results/cpu-2026-11-27-time-to-loss
    python scripts/bench_time_to_loss.py --tiny --out /tmp/ttl                 # the smallest run (CI)
    python scripts/bench_time_to_loss.py --jobs gpt2 --recipes adamw+cosine,muon+wsd --seeds 1 \\
        --lr adamw+cosine=6e-4 --lr muon+wsd=2e-3 --out OUT                   # on a GPU (gpu_figures.sh)

Recipes: AdamW + cosine, AdamW + wsd, Muon + cosine, Muon + wsd (``+optim=adamw|muon``,
``+schedule=cosine|wsd``, each at its defaults). Each recipe first runs the same small search: every
learning rate of ``--lrs`` on seed 0; it then trains at its best one (the lowest final eval loss) on
every seed of ``--seeds`` (seed 0's run is the search's). ``--lr RECIPE=LR`` fixes a recipe's lr
instead (no search). Every run is ``python -m looplib.train JOB RECIPE lr=LR seed=S``, evaluated every
``--eval-every`` steps on the job's fixed held-out set.

The target of a seed is the eval loss AdamW + cosine reaches at its last step on that seed. For
each recipe and seed: the first evaluated step at or below it, and the training seconds to that
step (wall time from the first step, less the evaluations'); then the ratios to AdamW + cosine's
own, and their median over the seeds.

The machine may be shared: runs go one at a time, each with ``OMP_NUM_THREADS`` fixed
(``--threads``), interleaved (search: for each lr, every recipe; then for each seed, every recipe,
the order rotated from seed to seed), so a change of load falls on every recipe alike; the
1-minute load average is recorded before and after every run. Written to --out:
time_to_loss.md, time_to_loss.json and time_to_loss.png (eval loss against steps and against
seconds, every seed, per job; matplotlib). The runs' directories go to --work (a temporary directory; only
the curves are kept); a run already in time_to_loss.json is not run again (an interrupted benchmark continues).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = {
    "adamw+cosine": ["+optim=adamw", "+schedule=cosine"],
    "adamw+wsd": ["+optim=adamw", "+schedule=wsd"],
    "muon+cosine": ["+optim=muon", "+schedule=cosine"],
    "muon+wsd": ["+optim=muon", "+schedule=wsd"],
}
BASELINE = "adamw+cosine"
# The jobs: overrides of conf/config.yaml (default: none at all). gpt2: GPT-2 small on a GPU.
JOBS = {
    "default": [],
    "llama": ["model=llama_tiny", "max_steps=150"],  # a tiny transformers Llama, half the steps
    "gpt2": ["model=gpt2_small", "model.seq_len=512", "data.max_bytes=20000000", "+precision=bf16", "batch_size=16",
             "max_steps=600", "eval_samples=256", "device=cuda"],
}
# --tiny: the same code path in seconds: a job keeps its model's kind and its strategy groups
# (+precision=...), at a tiny size on random tokens on the CPU (the recipes' warm-up fits 16 steps)
TINY = ["data=random", "data.n_train=64", "batch_size=8", "max_steps=16", "eval_samples=16",
        "schedule.warmup_steps=2", "device=cpu"]
TINY_MODELS = {"llama_tiny": ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
                              "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.seq_len=16"]}
TINY_GPT = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16"]


def tiny(job: list[str]) -> list[str]:
    model = next((a.split("=", 1)[1] for a in job if a.startswith("model=")), "tiny")
    kept = [a for a in job if a.startswith("model=") or a.startswith("+")]
    return [*kept, *TINY, *TINY_MODELS.get(model, TINY_GPT)]
FIXED = ["checkpoint.enabled=false", "sample_tokens=0", "progress=lines"]


def subprocess_runner(args: list[str], run_dir: Path, env: dict) -> int:
    """``python -m looplib.train ARGS`` in a fresh process (the test substitutes a warm one)."""
    with open(log_of(run_dir), "w") as log:
        return subprocess.call([sys.executable, "-m", "looplib.train", *args], stdout=log, stderr=subprocess.STDOUT,
                               env=env)


def log_of(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.log"  # (with_suffix would cut lr0.004-seed0 at its dot)


def curve(metrics: Path) -> dict:
    """Eval loss at every evaluated step, with the training seconds to it (elapsed less evaluations)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r}
    steps, losses, seconds, eval_s = [], [], [], 0.0
    for r in rows:
        if "eval_loss" in r:
            steps.append(r["step"])
            losses.append(r["eval_loss"])
            seconds.append(round(elapsed[r["step"]] - eval_s, 3))  # the train row of a step precedes its eval
            eval_s += r.get("eval_s", 0.0)
    step_times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]  # the first interval holds warm-up
    return {"steps": steps, "eval_loss": losses, "seconds": seconds,
            "step_time_s": statistics.median(step_times) if step_times else None}


def reached(c: dict, target: float) -> tuple[int | None, float | None]:
    """The first evaluated step at or below ``target``, and the training seconds to it."""
    for step, loss, s in zip(c["steps"], c["eval_loss"], c["seconds"]):
        if loss <= target:
            return step, s
    return None, None


class Bench:
    def __init__(self, args, runner=subprocess_runner):
        self.args, self.runner = args, runner
        self.out = Path(args.out)
        self.work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "looplib-time-to-loss" / self.out.name
        self.saved = self.out / "time_to_loss.json"
        self.data = json.loads(self.saved.read_text()) if self.saved.exists() else {"runs": {}}
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore", "LOOPLIB_PLOT": "0"}

    def job_args(self, job: str) -> list[str]:
        return [*(tiny(JOBS[job]) if self.args.tiny else JOBS[job]), f"eval_every={self.args.eval_every}",
                f"log_every={self.args.eval_every}", *FIXED]

    def run(self, job: str, recipe: str, lr: float, seed: int) -> dict:
        key = f"{job} {recipe} lr={lr:g} seed={seed}"
        if key in self.data["runs"]:
            return self.data["runs"][key]
        run_dir = self.work / job / recipe / f"lr{lr:g}-seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        args = [*self.job_args(job), *RECIPES[recipe], f"lr={lr!r}", f"seed={seed}", f"hydra.run.dir={run_dir}"]
        print(f"[bench] {key}", flush=True)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        status = self.runner(args, run_dir, self.env)
        wall = time.perf_counter() - t0
        if status != 0:
            raise SystemExit(f"[bench] {key} failed with status {status}: see {log_of(run_dir)}")
        result = {**curve(run_dir / "metrics.jsonl"), "wall_s": round(wall, 2), "load_before": round(load, 2),
                  "load_after": round(os.getloadavg()[0], 2), "args": args[:-1]}
        for heavy in run_dir.glob("*.safetensors"):
            heavy.unlink()  # the weights are not needed: the curve is the result
        self.data["runs"][key] = result
        self.save()
        return result

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.saved.write_text(json.dumps(self.data, indent=1) + "\n")

    def bench_job(self, job: str) -> dict:
        recipes, seeds, fixed = self.args.recipes, list(range(self.args.seeds)), dict(self.args.lr)
        searched = [r for r in recipes if r not in fixed]
        lrs = self.args.job_lrs.get(job, self.args.lrs)
        for lr in lrs:  # the search, seed 0: for each lr, every recipe
            for recipe in searched:
                self.run(job, recipe, lr, 0)
        search = {r: {f"{lr:g}": self.data["runs"][f"{job} {r} lr={lr:g} seed=0"]["eval_loss"][-1]
                      for lr in lrs} for r in searched}
        best = {r: float(min(search[r], key=search[r].get)) for r in searched} | fixed
        for i, seed in enumerate(seeds):  # the seeds, interleaved, the order rotated
            order = recipes[i % len(recipes):] + recipes[:i % len(recipes)]
            for recipe in order:
                self.run(job, recipe, best[recipe], seed)
        runs = {r: [self.data["runs"][f"{job} {r} lr={best[r]:g} seed={s}"] for s in seeds] for r in recipes}
        base = recipes[0]  # BASELINE when present
        rows = {r: [] for r in recipes}
        for s in seeds:
            target = runs[base][s]["eval_loss"][-1]
            base_step, base_s = reached(runs[base][s], target)
            for r in recipes:
                step, sec = reached(runs[r][s], target)
                rows[r].append({"seed": s, "target": target, "steps": step, "seconds": sec,
                                "steps_ratio": step / base_step if step else None,
                                "seconds_ratio": sec / base_s if sec else None,
                                "final_eval_loss": runs[r][s]["eval_loss"][-1],
                                "step_time_s": runs[r][s]["step_time_s"]})
        summary = {}
        for r in recipes:
            done = [x for x in rows[r] if x["steps"] is not None]
            summary[r] = {"lr": best[r], "reached": f"{len(done)}/{len(seeds)}",
                          "steps_ratio": median([x["steps_ratio"] for x in done]),
                          "seconds_ratio": median([x["seconds_ratio"] for x in done]),
                          "steps": median([x["steps"] for x in done]), "seconds": median([x["seconds"] for x in done]),
                          "final_eval_loss": median([x["final_eval_loss"] for x in rows[r]]),
                          "step_time_s": median([x["step_time_s"] for x in rows[r]])}
        loads = [v for k, run in self.data["runs"].items() if k.startswith(job + " ")
                 for v in (run["load_before"], run["load_after"])]
        return {"job": job, "overrides": self.job_args(job), "search": search, "best_lr": best, "per_seed": rows,
                "summary": summary, "load": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                "curves": {r: [{k: run[k] for k in ("steps", "eval_loss", "seconds")} for run in runs[r]]
                           for r in recipes}}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(results: list[dict], args, started: str) -> str:
    lines = [f"# Time to a loss: Muon and WSD against AdamW and cosine ({started})", "",
             f"    python scripts/bench_time_to_loss.py {' '.join(sys.argv[1:])}", "",
             f"Runs one at a time, OMP_NUM_THREADS={args.threads}, evaluated every {args.eval_every} steps; "
             f"lr search on seed 0 (each job's grid below); seeds 0-{args.seeds - 1}. "
             "Target per seed: the eval loss AdamW + cosine reaches at its last step. Ratios: the recipe's "
             "steps (seconds) to the target over AdamW + cosine's, median over the seeds.", ""]
    for res in results:
        job = " ".join(JOBS[res["job"]])
        lines += [f"## {res['job']}: `python -m looplib.train {job}`" + (" (conf/config.yaml as it is)" if not job else ""),
                  "", f"Every run adds `{' '.join(res['overrides'][len(JOBS[res['job']]):])}`, its recipe, `lr=` and "
                  "`seed=`.", "",
                  f"Load average (1 min) around the runs: median {res['load']['median']:.1f} "
                  f"(min {res['load']['min']:.1f}, max {res['load']['max']:.1f}) on {os.cpu_count()} cores.", "",
                  "| recipe | lr (best of search) | reached | steps to target | x steps | seconds to target | x seconds "
                  "| s/step | final eval loss |", "|---|---|---|---|---|---|---|---|---|"]
        for r, s in res["summary"].items():
            lines.append(f"| {r} | {s['lr']:g} | {s['reached']} | {fmt(s['steps'], '.0f')} | {fmt(s['steps_ratio'], '.2f')} "
                         f"| {fmt(s['seconds'], '.1f')} | {fmt(s['seconds_ratio'], '.2f')} | {fmt(s['step_time_s'], '.3f')} "
                         f"| {fmt(s['final_eval_loss'], '.4f')} |")
        lrs = sorted({float(lr) for by_lr in res["search"].values() for lr in by_lr})
        lines += ["", "Search (final eval loss, seed 0):", "", "| recipe | " + " | ".join(
            f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
        for r, by_lr in res["search"].items():
            lines.append(f"| {r} | " + " | ".join(fmt(by_lr.get(f"{lr:g}"), ".4f") for lr in lrs) + " |")
        lines += ["", "Per seed (steps / seconds to the target; target):", ""]
        for r, per in res["per_seed"].items():
            lines.append(f"- {r}: " + "; ".join(f"seed {x['seed']}: {fmt(x['steps'], '.0f')} / {fmt(x['seconds'], '.1f')} s "
                                                 f"(target {x['target']:.4f})" for x in per))
        lines.append("")
    return "\n".join(lines)


def chart(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'looplib[bench]'): no chart", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    colors = dict(zip(RECIPES, ("tab:blue", "tab:green", "tab:red", "tab:orange")))
    for row, res in zip(axes, results):
        target = median([x["target"] for x in next(iter(res["per_seed"].values()))])
        for r, runs in res["curves"].items():
            for i, c in enumerate(runs):
                label = f"{r} (lr {res['best_lr'][r]:g})" if i == 0 else None
                row[0].plot(c["steps"], c["eval_loss"], color=colors.get(r), alpha=0.8, lw=1, label=label)
                row[1].plot(c["seconds"], c["eval_loss"], color=colors.get(r), alpha=0.8, lw=1, label=label)
        low = min(min(c["eval_loss"]) for runs in res["curves"].values() for c in runs)
        for ax, xlabel in zip(row, ("optimizer step", "training seconds")):
            ax.axhline(target, color="grey", ls="--", lw=0.8)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("eval loss")
            ax.set_ylim(low - 0.05, target + 2 * (target - low) + 0.3)
            ax.set_title(f"{res['job']}: eval loss against {xlabel.split()[-1]} (dashed: target)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[bench] chart: {path}")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/time-to-loss")
    parser.add_argument("--work", default=None, help="the runs' directories (default: TMPDIR/looplib-time-to-loss/OUT's name)")
    parser.add_argument("--jobs", default="default,llama", help=f"of {', '.join(JOBS)}")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="the first is the baseline (the target's)")
    parser.add_argument("--lrs", action="append", default=[],
                        help="the search's learning rates (default 1e-3,2e-3,4e-3,8e-3); JOB=LRS: that job's own grid")
    parser.add_argument("--lr", action="append", default=[], help="RECIPE=LR: a fixed lr, no search")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    parser.add_argument("--tiny", action="store_true", help="each job at a tiny size (CI): the code path, not a figure")
    args = parser.parse_args(argv)
    args.jobs, args.recipes = args.jobs.split(","), args.recipes.split(",")
    grids = [x.split("=", 1) if "=" in x else (None, x) for x in args.lrs]
    args.job_lrs = {job: [float(v) for v in lrs.split(",")] for job, lrs in grids if job is not None}
    args.lrs = [float(v) for v in next((lrs for job, lrs in reversed(grids) if job is None), "1e-3,2e-3,4e-3,8e-3").split(",")]
    args.lr = [(k, float(v)) for k, v in (x.split("=", 1) for x in args.lr)]
    unknown = [x for x in [*args.recipes, *(k for k, _ in args.lr)] if x not in RECIPES] + \
        [j for j in [*args.jobs, *args.job_lrs] if j not in JOBS]
    if unknown:
        parser.error(f"unknown recipe or job {unknown[0]!r} (recipes: {', '.join(RECIPES)}; jobs: {', '.join(JOBS)})")
    if args.tiny:
        args.eval_every = min(args.eval_every, 2)
    return args


def main(argv=None, runner=subprocess_runner) -> list[dict]:
    args = parse(argv)
    started = time.strftime("%Y-%m-%d %H:%M")
    bench = Bench(args, runner)
    results = [bench.bench_job(job) for job in args.jobs]
    bench.data["results"] = results
    bench.data["meta"] = {"started": started, "finished": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:] if
                          argv is None else argv, "threads": args.threads, "cores": os.cpu_count()}
    bench.save()
    out = Path(args.out)
    (out / "time_to_loss.md").write_text(markdown(results, args, started))
    chart(results, out / "time_to_loss.png")
    print((out / "time_to_loss.md").read_text())
    return results


if __name__ == "__main__":
    main()
