"""The local engine against DeepSpeed ZeRO-2/ZeRO-3 with CPU offload, through looplib's own CLI.

    python scripts/bench_engines.py                # GPU: the BERT-large-sized classifier, bf16
    python scripts/bench_engines.py --small        # CPU: the tiny GPT, ZeRO without offload (a smoke run)
    python scripts/bench_engines.py --rows local,zero3_offload --steps 30 --out results/

Each row is one `python -m looplib.train` process on one device. Printed and written to --out:
engines_bench.md (a markdown table), engines_bench.json and engines_bench.png (matplotlib, if
installed). samples/s leaves out the first two steps (warm-up, DeepSpeed's first offload
step); peak memory is the CUDA allocator's peak on the GPU (the CPU's peak RSS on a CPU).
Speed and memory are also given as ratios to the local row measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DS = ["+engine=deepspeed"]
ROWS = {
    "local": ("local engine, AdamW", []),
    "zero2": ("ZeRO-2, AdamW", [*DS, "engine.stage=2"]),
    "zero2_offload": ("ZeRO-2, optimizer offload to CPU, CPU Adam",
                      [*DS, "engine.stage=2", "engine.offload_optimizer=cpu", "+optim=cpu_adam"]),
    "zero3": ("ZeRO-3, AdamW", [*DS, "engine.stage=3"]),
    "zero3_offload": ("ZeRO-3, optimizer and parameter offload to CPU, CPU Adam",
                      [*DS, "engine.stage=3", "engine.offload_optimizer=cpu", "engine.offload_params=cpu",
                       "+optim=cpu_adam"]),
}
GPU_ROWS = "local,zero2_offload,zero3_offload"
SMALL_ROWS = "local,zero2,zero3"  # offload on a CPU-only machine would move CPU memory to the CPU

GPU_JOB = ["model=bert_large", "data=classification", "loss=classification", "data.n_train=512", "lr=1e-5",
           "batch_size=4", "+precision=bf16"]
SMALL_JOB = ["model=tiny", "data=random", "model.n_layer=2", "model.d_model=64", "model.seq_len=64",
             "batch_size=8", "lr=1e-3"]


def run_row(name: str, overrides: list[str], job: list[str], steps: int, out: Path) -> dict:
    run_dir = out / "runs" / name
    args = [sys.executable, "-m", "looplib.train", *job, *overrides, f"max_steps={steps}", "log_every=1",
            "eval_every=0", "eval_batches=0", "sample_tokens=0", "progress=lines", f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise SystemExit(f"row {name} failed:\n{' '.join(args)}\n{done.stderr[-3000:]}\n{done.stdout[-2000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    timed = [r["samples_per_s"] for r in train[2:]] or [train[-1]["samples_per_s"]]
    return {"row": name, "what": ROWS[name][0], "samples_per_s": statistics.median(timed),
            "peak_mem_mb": max(r["peak_mem_mb"] for r in train), "final_loss": train[-1]["loss"],
            "wall_s": time.perf_counter() - t0, "command": " ".join(args[1:])}


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["row"] == "local"), results[0])
    lines = ["| run | samples/s | x local | peak memory MB | x local | final loss |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['what']} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / base['samples_per_s']:.2f} "
                     f"| {r['peak_mem_mb']:.0f} | {r['peak_mem_mb'] / base['peak_mem_mb']:.2f} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def chart(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["row"] for r in results]
    axes[0].barh(names, [r["samples_per_s"] for r in results])
    axes[0].set_xlabel("samples/s")
    axes[1].barh(names, [r["peak_mem_mb"] for r in results])
    axes[1].set_xlabel("peak memory MB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU smoke run: tiny GPT, ZeRO without offload")
    ap.add_argument("--rows", default=None, help=f"comma-separated, from {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_engines"))
    args = ap.parse_args()
    rows = (args.rows or (SMALL_ROWS if args.small else GPU_ROWS)).split(",")
    job = SMALL_JOB + ["device=cpu"] if args.small else GPU_JOB
    steps = args.steps or (6 if args.small else 30)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in rows:
        results.append(run_row(name, ROWS[name][1], job, steps, args.out))
        print(f"{name}: {results[-1]['samples_per_s']:.2f} samples/s, {results[-1]['peak_mem_mb']:.0f} MB", flush=True)
    md = table(results)
    print(md)
    (args.out / "engines_bench.md").write_text(md + "\n")
    (args.out / "engines_bench.json").write_text(json.dumps(results, indent=2))
    chart(results, args.out / "engines_bench.png")


if __name__ == "__main__":
    main()
