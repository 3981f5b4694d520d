"""The engines side by side: local, DDP, FSDP2 and DeepSpeed ZeRO-2/ZeRO-3 (with CPU offload), through looplib's CLI.

    python scripts/bench_engines.py                # GPU: the BERT-large-sized classifier, bf16
    python scripts/bench_engines.py --small        # CPU: the tiny GPT, ZeRO without offload (a smoke run)
    python scripts/bench_engines.py --rows local,zero3_offload --steps 30 --out results/
    python scripts/bench_engines.py --small --nproc 2 --rows ddp,fsdp,fsdp_keep,zero2,zero3   # 2 processes each

Each row is one `python -m looplib.train` process on one device, or with --nproc N, N processes
under torchrun (figures are rank 0's: samples/s and peak memory per rank). Printed and written to --out:
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

from looplib.process.launcher import free_port

DS = ["+engine=deepspeed"]
ROWS = {
    "local": ("local engine, AdamW", []),
    "zero2": ("ZeRO-2, AdamW", [*DS, "engine.stage=2"]),
    "zero2_offload": ("ZeRO-2, optimizer offload to CPU, CPU Adam",
                      [*DS, "engine.stage=2", "engine.offload_optimizer=cpu", "+optim=cpu_adam"]),
    "zero3": ("ZeRO-3, AdamW", [*DS, "engine.stage=3"]),
    "ddp": ("DDP, AdamW", ["+engine=ddp"]),
    "fsdp": ("FSDP2, AdamW", ["+engine=fsdp"]),
    "fsdp_keep": ("FSDP2, reshard_after_forward=false, AdamW", ["+engine=fsdp", "engine.reshard_after_forward=false"]),
    "fsdp_offload": ("FSDP2, CPU offload, AdamW", ["+engine=fsdp", "engine.offload=cpu"]),
    "zero3_offload": ("ZeRO-3, optimizer and parameter offload to CPU, CPU Adam",
                      [*DS, "engine.stage=3", "engine.offload_optimizer=cpu", "engine.offload_params=cpu",
                       "+optim=cpu_adam"]),
}
GPU_ROWS = "local,fsdp,fsdp_offload,zero2_offload,zero3_offload"
SMALL_ROWS = "local,zero2,zero3"  # offload on a CPU-only machine would move CPU memory to the CPU

GPU_JOB = ["model=bert_large", "data=classification", "loss=classification", "data.n_train=512", "lr=1e-5",
           "batch_size=4", "+precision=bf16"]
SMALL_JOB = ["model=tiny", "data=random", "model.n_layer=2", "model.d_model=64", "model.seq_len=64",
             "batch_size=8", "lr=1e-3"]


def table(results: list[dict], title: str) -> str:
    base = next((r for r in results if r["row"] == "local"), results[0])
    ref = "local" if base["row"] == "local" else base["row"]
    lines = [f"### {title}", "", f"| run | samples/s | x {ref} | peak memory MB | x {ref} | final loss |",
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
    ap.add_argument("--nproc", type=int, default=1, help="processes per row (torchrun); figures are per rank")
    ap.add_argument("--set", nargs="*", default=[], help="further overrides for every row, e.g. model.d_model=512")
    args = ap.parse_args(argv)
    names = [n for n in (args.rows or (SMALL_ROWS if args.small else GPU_ROWS)).split(",") if n]
    unknown = set(names) - set(ROWS)
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    if args.nproc > 1 and "local" in names:
        ap.error("the local engine is one process: leave it out of --rows with --nproc > 1")
    device = "cpu" if args.small else "cuda"
    job = [*(SMALL_JOB if args.small else GPU_JOB), *args.set]
    steps = args.steps or (6 if args.small else 30)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        label, overrides = ROWS[name]
        # the median step after the first (warm-up; DeepSpeed's first offload step is slower still)
        launcher = ("-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
                    str(free_port())) if args.nproc > 1 else ()
        row = run_row(name, overrides, job, steps, device, args.out, launcher)
        row.update(label=label, samples_per_s=row.pop("median_samples_per_s"))
        results.append(row)
        print(f"{label:<60} {row['samples_per_s']:8.2f} samples/s  {row['peak_mem_mb']:10,.0f} MB peak", flush=True)
    model = "tiny GPT" if args.small else "bert_large, bf16"
    title = (f"{model}, {device}, {steps} steps per row, {args.nproc} process(es) each, {time.strftime('%Y-%m-%d')}; "
             f"`python scripts/bench_engines.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    md = table(results, title)
    print("\n" + md)
    (args.out / "engines_bench.md").write_text(md)
    (args.out / "engines_bench.json").write_text(json.dumps({"title": title, "job": job, "rows": results}, indent=2))
    chart(results, title, args.out / "engines_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
