"""The guides' memory experiment, row by row, through looplib's own command line.

    python scripts/bench_memory.py              # GPU: BERT-large classifier, 512 sequences of 512 tokens, one epoch per row
    python scripts/bench_memory.py --small      # CPU: a tiny BERT, a few steps per row (under two minutes)
    python scripts/bench_memory.py --rows vanilla,all --steps 20 --out results/

Each row is one `python -m looplib.train` process (so a process-wide peak, such as the CPU's
peak RSS, belongs to that row alone). Printed and written to --out: memory_bench.md (a
markdown table), memory_bench.json (every figure) and memory_bench.png (a chart; needs
matplotlib: pip install 'looplib[bench]'). samples/s leaves out the first step (warm-up);
speed and memory are also given as ratios to the vanilla row measured in the same run.
"planned MB" is the peak `python -m looplib.plan` predicts for the row:
on a GPU compare it with the allocator's peak (the JSON holds the relative error); on a CPU
the peak is the whole process's RSS (Python and torch included), so only the plan shows the
model's share.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROWS = {  # name: (what the guides call it, overrides); {mixed} is fp16 on a GPU, bf16 on a CPU
    "vanilla": ("batch 4", ["batch_size=4"]),
    "accumulation": ("batch 1, accumulation 4", ["batch_size=1", "accum_steps=4"]),
    "checkpointing": ("+ activation checkpointing", ["batch_size=1", "accum_steps=4", "+checkpointing=blocks"]),
    "mixed": ("batch 4, {mixed}", ["batch_size=4", "+precision={mixed}"]),
    "adafactor": ("batch 4, Adafactor", ["batch_size=4", "+optim=adafactor"]),
    "adam8bit": ("batch 4, 8-bit Adam", ["batch_size=4", "+optim=adam8bit"]),
    "all": ("8-bit Adam + accumulation + checkpointing + {mixed}",
            ["batch_size=1", "accum_steps=4", "+checkpointing=blocks", "+precision={mixed}", "+optim=adam8bit"]),
}

GPU_JOB = ["model=bert_large", "data=classification", "loss=classification", "data.n_train=512", "lr=1e-5"]
SMALL_JOB = ["model=bert_tiny", "data=classification", "loss=classification", "data.vocab_size=1024", "lr=1e-4"]


def run_row(name: str, overrides: list[str], job: list[str], steps: int, device: str, out: Path,
            launcher: tuple[str, ...] = ()) -> dict:
    """One training process (``launcher``: e.g. torchrun's arguments, for several); rank 0's figures."""
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own row: a new measurement replaces it
    module = [*launcher, "-m", "looplib.train"] if launcher else ["-m", "looplib.train"]
    args = [sys.executable, *module, *job, *overrides, f"max_steps={steps}", f"device={device}",
            "log_every=1", "eval_every=0", "eval_samples=0", "sample_tokens=0", "progress=lines",
            "checkpoint.enabled=false", f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise SystemExit(f"row {name} failed:\n{' '.join(args)}\n{done.stderr[-2000:]}")
    (run_dir / "model.safetensors").unlink(missing_ok=True)  # bert_large's is 1.3 GB: rows would fill a disk
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    timed = train[1:] or train  # leave out the warm-up step
    samples = sum(r["samples_per_s"] * r["step_time_s"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    return {"row": name, "overrides": overrides, "steps": len(train), "samples_per_s": samples / seconds,
            "peak_mem_mb": max(r["peak_mem_mb"] for r in train),
            "device_mem_used_mb": max((r.get("device_mem_used_mb", 0) for r in train), default=0) or None,
            "host_peak_rss_mb": max(r["host_peak_rss_mb"] for r in train),
            "final_loss": train[-1]["loss"], "wall_s": time.perf_counter() - t0,
            "train_s": sum(r["step_time_s"] for r in train),
            "median_samples_per_s": statistics.median(r["samples_per_s"] for r in timed)}


def planned_mb(job: list[str], overrides: list[str], device: str) -> float:
    """What ``python -m looplib.plan`` predicts for the row: static bytes + activations."""
    from hydra import compose, initialize_config_module

    from looplib.cli.plan import build_plan
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*job, *overrides, "device=cpu"])
    plan = build_plan(cfg, memory=1)
    return plan.peak(plan.micro_batch) / 2**20


def markdown(results: list[dict], title: str, gpu: bool) -> str:
    base = results[0]
    head = "| run | samples/s | x first row | peak memory MB | x first row | planned MB |" + \
        (" NVML used MB |" if gpu else "")
    lines = [f"### {title}", "", head, "|" + "---|" * (7 if gpu else 6)]
    for r in results:
        cells = [r["label"], f"{r['samples_per_s']:.2f}", f"{r['samples_per_s'] / base['samples_per_s']:.2f}",
                 f"{r['peak_mem_mb']:,.0f}", f"{r['peak_mem_mb'] / base['peak_mem_mb']:.2f}",
                 f"{r['planned_mb']:,.1f}"]
        if gpu:
            cells.append(f"{r['device_mem_used_mb']:,.0f}" if r["device_mem_used_mb"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(results: list[dict], title: str, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'looplib[bench]'): no chart", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results][::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(results) + 1.5), sharey=True)
    left.barh(labels, [r["samples_per_s"] for r in results][::-1], color="tab:blue")
    left.set_xlabel("samples/s (higher is better)")
    right.barh(labels, [r["peak_mem_mb"] for r in results][::-1], color="tab:orange")
    right.set_xlabel("peak memory MB (lower is better)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CPU version: a tiny BERT, a few steps per row")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per row (default: one epoch on "
                        "the GPU, 6 with --small)")
    parser.add_argument("--device", default=None, help="default: cpu with --small, cuda otherwise")
    parser.add_argument("--out", type=Path, default=Path("bench_memory"))
    args = parser.parse_args(argv)
    names = [n for n in args.rows.split(",") if n]
    unknown = set(names) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    device = args.device or ("cpu" if args.small else "cuda")
    gpu = device.startswith("cuda")
    mixed = "fp16" if gpu else "bf16"
    steps = args.steps or (6 if args.small else 128)  # 128 steps x 4 sequences = the guides' 512 sequences
    job = SMALL_JOB + [f"data.n_train={4 * steps}"] if args.small else GPU_JOB
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        label, overrides = ROWS[name]
        overrides = [o.format(mixed=mixed) for o in overrides]
        result = run_row(name, overrides, job, steps, device, args.out)
        result["label"] = label.format(mixed=mixed)
        result["planned_mb"] = planned_mb(job, overrides, device)
        if gpu:  # the planner's error against the allocator's peak
            result["plan_error"] = result["planned_mb"] / result["peak_mem_mb"] - 1
        results.append(result)
        print(f"{result['label']:<55} {result['samples_per_s']:8.2f} samples/s  {result['peak_mem_mb']:10,.0f} MB "
              f"peak  ({result['wall_s']:.0f} s)", flush=True)
    model = "bert_tiny (CPU)" if args.small else "bert_large"
    title = f"{model}, {device}, {steps} steps per row, {'fp16' if gpu else 'bf16'} for mixed precision"
    table = markdown(results, title, gpu)
    (args.out / "memory_bench.md").write_text(table)
    (args.out / "memory_bench.json").write_text(json.dumps({"title": title, "device": device, "job": job,
                                                            "rows": results}, indent=2))
    chart(results, title, args.out / "memory_bench.png")
    print("\n" + table)
    print(f"written: {args.out}/memory_bench.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
