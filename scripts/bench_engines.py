"""The local engine against DeepSpeed ZeRO-2/ZeRO-3 with CPU offload, through looplib's own CLI.

    python scripts/bench_engines.py                # GPU: the BERT-large-sized classifier, bf16
    python scripts/bench_engines.py --small        # CPU: the tiny GPT, ZeRO without offload (a smoke run)
    python scripts/bench_engines.py --rows local,zero3_offload --steps 30 --out results/

Each row is one `python -m looplib.train` process on one device. Printed and written to --out:
engines_bench.md (a markdown table), engines_bench.json and engines_bench.png (matplotlib, if
installed). samples/s is the median step after the first (warm-up; DeepSpeed's first offload
step is slower still); peak memory is the CUDA allocator's peak on the GPU (the CPU's peak RSS on a CPU).
Speed and memory are also given as ratios to the local row measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import chart, run_row

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


def table(results: list[dict], title: str) -> str:
    base = next((r for r in results if r["row"] == "local"), results[0])
    lines = [f"### {title}", "", "| run | samples/s | x local | peak memory MB | x local | final loss |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['label']} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / base['samples_per_s']:.2f} "
                     f"| {r['peak_mem_mb']:.0f} | {r['peak_mem_mb'] / base['peak_mem_mb']:.2f} | {r['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU smoke run: tiny GPT, ZeRO without offload")
    ap.add_argument("--rows", default=None, help=f"comma-separated, from {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_engines"))
    args = ap.parse_args(argv)
    names = [n for n in (args.rows or (SMALL_ROWS if args.small else GPU_ROWS)).split(",") if n]
    unknown = set(names) - set(ROWS)
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    device = "cpu" if args.small else "cuda"
    job = SMALL_JOB if args.small else GPU_JOB
    steps = args.steps or (6 if args.small else 30)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        label, overrides = ROWS[name]
        # the median step after the first (warm-up; DeepSpeed's first offload step is slower still)
        row = run_row(name, overrides, job, steps, device, args.out)
        row.update(label=label, samples_per_s=row.pop("median_samples_per_s"))
        results.append(row)
        print(f"{label:<60} {row['samples_per_s']:8.2f} samples/s  {row['peak_mem_mb']:10,.0f} MB peak", flush=True)
    model = "tiny GPT" if args.small else "bert_large, bf16"
    title = (f"{model}, {device}, {steps} steps per row, {time.strftime('%Y-%m-%d')}; "
             f"`python scripts/bench_engines.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    md = table(results, title)
    print("\n" + md)
    (args.out / "engines_bench.md").write_text(md)
    (args.out / "engines_bench.json").write_text(json.dumps({"title": title, "job": job, "rows": results}, indent=2))
    chart(results, title, args.out / "engines_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
