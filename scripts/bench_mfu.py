"""Model FLOPs utilisation: a GPT-2-small-sized run against the device's measured matmul peak.

    python scripts/bench_mfu.py                  # GPU: gpt2_small, sequence 1024, bf16, fused AdamW, SDPA,
                                                 #      eager and +compile=default; peak = a large bf16 matmul loop
    python scripts/bench_mfu.py --small          # CPU: the tiny GPT, fp32 (and bf16 where the CPU has it)
    python scripts/bench_mfu.py --small --rows fp32 --steps 3 --out results/
    python scripts/bench_mfu.py --rows eager,compile --add best=+precision=bf16,...,batch_size=16

GPU rows climb from the eager bf16 baseline (GPT-2's own vocabulary, 50,257) one change at a
time: padded vocabulary, torch.compile, the loss compiled with the model, the chunked (or Liger)
linear + cross-entropy, max-autotune, CUDA graphs, the largest micro-batch that fits, fp8. Rows a
device cannot run come back "refused" with looplib's one-line reason.

First the peak: the best of a few timed loops of square matmuls in the row's dtype (8192 wide
on a GPU, 1024 on a CPU), 2 n^3 FLOPs each. Then each row is one `python -m looplib.train`
process given that peak (`peak_tflops=`), so its metrics.jsonl carries tokens/s, TFLOP/s and
MFU (model FLOPs: 6 x parameters in matmuls per token plus attention, no recomputation). The
figures are medians over the steps after warm-up (and compilation). MFU against the measured
peak is what this model could reach on this device; against the datasheet it would be lower.
Written to --out: mfu_bench.md and mfu_bench.json.
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

import torch

# name: (label, overrides, dtype of the matmul peak it is measured against). The GPU rows climb a
# ladder from the eager baseline (GPT-2's own vocabulary, 50,257) one change at a time; every row
# names all its overrides, so any row can be run alone (--rows) and new ones composed (--add).
def merge(*overrides: list[str]) -> list[str]:
    """Command-line overrides, later ones replacing earlier ones of the same key (``+group=x`` and
    ``group=x`` are one key); a group's own keys (``compile.loss``) go when the group is replaced
    by one that is not the same option."""
    out: dict[str, str] = {}
    for item in (o for group in overrides for o in group):
        key, _, value = item.partition("=")
        out[key.lstrip("+")] = item
    return list(out.values())


BF16 = ["+precision=bf16", "+optim=adamw", "optim.impl=fused"]
PAD = ["model.pad_vocab_to=64"]
COMPILED = BF16 + PAD + ["+compile=default"]
GPU_ROWS = {
    "eager": ("bf16, fused AdamW, SDPA", BF16, torch.bfloat16),
    "pad_vocab": ("+ vocabulary padded to 50,304", BF16 + PAD, torch.bfloat16),
    "compile": ("+ torch.compile", COMPILED, torch.bfloat16),
    "compile_loss": ("+ loss compiled with the model", COMPILED + ["compile.loss=true"], torch.bfloat16),
    "chunked": ("+ chunked linear + cross-entropy", COMPILED + ["loss=lm_chunked"], torch.bfloat16),
    "liger": ("+ Liger fused linear + cross-entropy", COMPILED + ["loss=lm_liger"], torch.bfloat16),
    "max_autotune": ("+ max-autotune, loss compiled", BF16 + PAD + ["+compile=max_autotune", "compile.loss=true"],
                     torch.bfloat16),
    "reduce_overhead": ("+ CUDA graphs (reduce-overhead)", BF16 + PAD + ["+compile=reduce_overhead"], torch.bfloat16),
    "batch_auto": ("+ largest micro-batch that fits (auto, global 64)", COMPILED + ["compile.loss=true",
                   "batch_size=auto", "global_batch_size=64"], torch.bfloat16),
    "fp8": ("+ fp8 matmuls (torchao), loss compiled", ["+precision=fp8", "+optim=adamw", "optim.impl=fused"] + PAD
            + ["+compile=default", "compile.loss=true"], torch.bfloat16),
    # issue 33's options
    "compile_optimizer": ("+ optimizer step compiled (foreach AdamW, inductor-fused), loss compiled",
                          merge(COMPILED, ["compile.loss=true", "optim.impl=foreach", "compile.optimizer=true"]),
                          torch.bfloat16),
    "graphs_step": ("+ CUDA graphs over forward and backward, the optimizer step compiled",
                    merge(BF16, PAD, ["+compile=reduce_overhead", "optim.impl=foreach", "compile.optimizer=true"]),
                    torch.bfloat16),
    "regional": ("torch.compile of each block (regional: cold start flat in depth)",
                 BF16 + PAD + ["+compile=default", "compile.regional=true"], torch.bfloat16),
    "batch16": ("+ micro-batch 16 (global 16), loss compiled", COMPILED + ["compile.loss=true", "batch_size=16"],
                torch.bfloat16),
    "fp8_rowwise": ("+ fp8 matmuls, rowwise scales (torchao), loss compiled",
                    ["+precision=fp8", "precision.recipe=rowwise", "+optim=adamw", "optim.impl=fused"] + PAD
                    + ["+compile=default", "compile.loss=true"], torch.bfloat16),
}
# --best: the options a ladder row adds over the compiled row, combined where they beat it (by
# more than 1%). Each is (row, overrides it adds); rows in one tuple exclude each other (the
# faster one is taken): the loss (compiled, chunked or Liger), the fp8 recipe.
BEST_BASE = "compile"
BEST_OPTIONS = [
    (("compile_loss", ["compile.loss=true"]), ("liger", ["loss=lm_liger"]), ("chunked", ["loss=lm_chunked"])),
    (("compile_optimizer", ["optim.impl=foreach", "compile.optimizer=true"]),),
    (("reduce_overhead", ["+compile=reduce_overhead"]),),
    (("batch16", ["batch_size=16"]),),
    (("fp8", ["+precision=fp8"]), ("fp8_rowwise", ["+precision=fp8", "precision.recipe=rowwise"])),
]


def best_row(results: list[dict]) -> tuple[list[str], list[str]] | None:
    """The combination of the ladder's options that each beat the compiled row: (overrides, the
    rows it takes from); None without an ok compiled row."""
    ok = {r["row"]: r for r in results if r["status"] == "ok"}
    base = ok.get(BEST_BASE)
    if base is None:
        return None
    chosen, taken = [], []
    for choices in BEST_OPTIONS:
        better = [(ok[row]["tokens_per_s"], row, add) for row, add in choices
                  if row in ok and ok[row]["tokens_per_s"] > 1.01 * base["tokens_per_s"]]
        if better:
            _, row, add = max(better)
            chosen.append(add)
            taken.append(row)
    return merge(GPU_ROWS[BEST_BASE][1], *chosen), taken
CPU_ROWS = {
    "fp32": ("fp32, foreach AdamW, SDPA", ["+optim=adamw", "optim.impl=foreach"], torch.float32),
    "bf16": ("bf16 autocast, foreach AdamW, SDPA", ["+precision=bf16", "+optim=adamw", "optim.impl=foreach"],
             torch.bfloat16),
    "compile": ("fp32, torch.compile", ["+optim=adamw", "optim.impl=foreach", "+compile=default"], torch.float32),
    "pad_vocab": ("fp32, vocabulary padded 500 -> 512", ["+optim=adamw", "optim.impl=foreach", *PAD], torch.float32),
    "chunked": ("fp32, chunked linear + cross-entropy", ["+optim=adamw", "optim.impl=foreach", "loss=lm_chunked",
                                                         "loss.chunk_size=256"], torch.float32),
    "compile_loss": ("fp32, torch.compile of model and loss", ["+optim=adamw", "optim.impl=foreach", "+compile=default",
                                                                "compile.loss=true"], torch.float32),
    "batch_auto": ("fp32, batch_size=auto (global 16)", ["+optim=adamw", "optim.impl=foreach", "batch_size=auto",
                                                          "global_batch_size=16"], torch.float32),
    "reduce_overhead": ("CUDA graphs (reduce-overhead)", ["+compile=reduce_overhead"], torch.float32),
    "fp8": ("fp8 matmuls (torchao)", ["+precision=fp8"], torch.bfloat16),
}
GPU_JOB = ["model=gpt2_small", "data=random", "data.vocab_size=50257", "loss=lm", "batch_size=8", "lr=3e-4"]
SMALL_JOB = ["model=tiny", "data=random", "data.vocab_size=500", "loss=lm", "batch_size=8", "lr=1e-3"]


def matmul_peak(dtype: torch.dtype, device: torch.device, n: int, seconds: float = 1.0) -> float:
    """Measured dense matmul FLOP/s: the best of 3 timed loops of (n x n) @ (n x n)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = 0.0
    for _ in range(3):
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            a @ b
            count += 1
            if device.type == "cuda" and count % 10:
                continue
            sync()
        sync()
        best = max(best, 2 * n**3 * count / (time.perf_counter() - t0))
    return best


def cpu_has_bf16() -> bool:
    """bf16 matmuls in hardware (AVX512-BF16 or AMX); without them CPU bf16 is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def run_row(name: str, overrides: list[str], job: list[str], steps: int, warmup: int, device: str,
            peak_tflops: float, out: Path) -> dict:
    """One row in its own process. A row the device cannot run comes back refused, with looplib's
    one-line reason (exit status 2: fp8 or CUDA graphs on a CPU, liger-kernel not installed)."""
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own row: a new measurement replaces it
    args = [sys.executable, "-m", "looplib.train", *job, *overrides, f"max_steps={warmup + steps}",
            f"device={device}", f"peak_tflops={peak_tflops}", "log_every=1", "eval_every=0", "eval_samples=0",
            "sample_tokens=0", "progress=lines", "checkpoint.enabled=false", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(args, check=False, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode == 2 and "looplib: error:" in done.stderr:
        reason = done.stderr.strip().splitlines()[-1].removeprefix("looplib: error: ")
        return {"row": name, "overrides": overrides, "status": "refused", "reason": reason}
    if done.returncode != 0:
        return {"row": name, "overrides": overrides, "status": "failed",
                "reason": (done.stderr.strip().splitlines() or ["?"])[-1][:300], "command": " ".join(args)}
    (run_dir / "model.safetensors").unlink(missing_ok=True)  # GPT-2 small's is 0.5 GB
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    timed = train[warmup:]
    compiled = next((r for r in reversed(rows) if "compile_s" in r), {})  # cumulative: the last row has all
    config = (run_dir / "config.yaml").read_text()
    batch = next((line.split(":")[1].strip() for line in config.splitlines() if line.startswith("batch_size:")), "?")
    return {"row": name, "overrides": overrides, "status": "ok", "steps": len(timed), "micro_batch": batch,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "tflops": statistics.median(r["tflops"] for r in timed),
            "mfu": statistics.median(r["mfu"] for r in timed),
            "peak_mem_mb": max(r["peak_mem_mb"] for r in timed),
            "first_step_s": train[0]["step_time_s"], "median_step_s": statistics.median(r["step_time_s"] for r in timed),
            "compile_s": compiled.get("compile_s"), "final_loss": train[-1]["loss"]}


def markdown(results: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| run | tokens/s | x first row | model TFLOP/s | measured peak TFLOP/s | MFU | "
             "micro-batch | peak MB | first step s | compile s | loss at end |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in results if r["status"] == "ok"), None)
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['status']}: {r['reason']} |" + " - |" * 9)
            continue
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        lines.append(f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}"
                     f" | {r['tflops']:.3g} | {r['peak_tflops']:.3g} | {100 * r['mfu']:.1f}% | {r['micro_batch']} | "
                     f"{r['peak_mem_mb']:,.0f} | {r['first_step_s']:.1f} | {compile_s} | {r['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CPU version: the tiny GPT, a few steps")
    parser.add_argument("--rows", default=None, help=f"comma-separated subset (GPU: {','.join(GPU_ROWS)}; "
                        f"--small: {','.join(CPU_ROWS)})")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 30; 5 with --small)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out (default 10: compilation)")
    parser.add_argument("--device", default=None, help="default: cpu with --small, cuda otherwise")
    parser.add_argument("--out", type=Path, default=Path("bench_mfu"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for the peak and every row "
                        "(default 1 with --small: steadier on a shared machine)")
    parser.add_argument("--best", action="store_true", help="after the rows, one more: the options whose rows beat "
                        "the compiled row by more than 1%%, combined (GPU)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole ladder: rows that would "
                        "start after budget minus the slowest row so far are left out (said in the table), so that "
                        "--best still runs")
    parser.add_argument("--add", action="append", default=[], metavar="NAME=OVERRIDE,OVERRIDE",
                        help="a further row from looplib overrides, e.g. --add best=+precision=bf16,+optim=adamw,"
                        "optim.impl=fused,model.pad_vocab_to=64,+compile=default,batch_size=16 (repeatable)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.small else "cuda"))
    table = dict(CPU_ROWS if device.type == "cpu" else GPU_ROWS)
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:  # the same threads for the measured peak and for each row's process
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    names = [n for n in (args.rows or ",".join(table)).split(",") if n]
    unknown = set(names) - set(table)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {','.join(table)}")
    for spec in args.add:
        name, _, overrides = spec.partition("=")
        if not name or not overrides:
            parser.error(f"--add {spec!r}: use NAME=OVERRIDE,OVERRIDE,...")
        half = any(o in overrides for o in ("precision=bf16", "precision=fp8", "precision=fp16"))
        table[name] = (f"{name}: {overrides.replace(',', ' ')}", overrides.split(","),
                       torch.bfloat16 if half else torch.float32)
        names.append(name)
    skipped = {}
    if device.type == "cpu" and "bf16" in names and not cpu_has_bf16() and args.rows is None:
        names.remove("bf16")
        skipped["bf16"] = "this CPU has no bf16 matmul instructions (avx512_bf16/amx_bf16): emulated, not a peak"
    steps = args.steps or (5 if args.small else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.small else 10)
    job = SMALL_JOB if args.small else GPU_JOB
    n = 1024 if device.type == "cpu" else 8192
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {threads} thread(s)"
    model = "tiny GPT (4 layers, 128 wide, sequence 128, vocabulary 500)" if args.small else \
        "GPT-2 small (124M), sequence 1024, vocabulary 50,257"
    title = f"{model}, batch 8 unless said, {name}, median of {steps} steps after {warmup} warm-up"
    peaks, results, t_start, slowest = {}, [], time.perf_counter(), 0.0
    for row_name in names:
        label, overrides, dtype = table[row_name]
        if args.budget_s and time.perf_counter() - t_start + slowest > args.budget_s - (slowest if args.best else 0):
            skipped[row_name] = f"left out: the ladder's budget of {args.budget_s:.0f} s (--budget-s) would run out"
            print(f"{label:<50} {skipped[row_name]}", flush=True)
            continue
        t_row = time.perf_counter()
        if dtype not in peaks:
            peaks[dtype] = matmul_peak(dtype, device, n) / 1e12
            print(f"measured {dtype} matmul peak ({n} wide): {peaks[dtype]:.3g} TFLOP/s", flush=True)
        row = run_row(row_name, overrides, job, steps, warmup, device.type, peaks[dtype], args.out)
        row.update(label=label, peak_tflops=peaks[dtype], peak_dtype=str(dtype).removeprefix("torch."),
                   wall_s=round(time.perf_counter() - t_row, 1))
        slowest = max(slowest, row["wall_s"])
        results.append(row)
        if row["status"] == "ok":
            print(f"{label:<50} {row['tokens_per_s']:12,.0f} tokens/s  MFU {100 * row['mfu']:.1f}%", flush=True)
        else:
            print(f"{label:<50} {row['status']}: {row['reason']}", flush=True)
        write(args.out, title, results, skipped, device, job, n)  # after every row: a cut run keeps its rows
    found = best_row(results) if args.best else None
    if args.best and found is None:
        skipped["best"] = f"no ok {BEST_BASE} row to build on"
    elif found:
        overrides, taken = found
        label = "best combination: " + (" + ".join(taken) if taken else f"{BEST_BASE} (no option beat it)")
        dtype = torch.bfloat16
        peaks.setdefault(dtype, matmul_peak(dtype, device, n) / 1e12)
        row = run_row("best", overrides, job, steps, warmup, device.type, peaks[dtype], args.out)
        row.update(label=label, peak_tflops=peaks[dtype], peak_dtype="bfloat16", taken=taken)
        results.append(row)
    text = write(args.out, title, results, skipped, device, job, n)
    print("\n" + text)
    print(f"written: {args.out}/mfu_bench.md, .json")
    return 0


def write(out: Path, title: str, results: list[dict], skipped: dict, device, job: list[str], n: int) -> str:
    text = markdown(results, title) if results else f"### {title}\n\nno rows ran\n"
    for row, why in skipped.items():
        text += f"\n{row}: skipped, {why}\n"
    (out / "mfu_bench.md").write_text(text)
    (out / "mfu_bench.json").write_text(json.dumps({"title": title, "device": str(device), "job": job, "matmul_n": n,
                                                    "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                                    "skipped": skipped, "rows": results}, indent=2))
    return text


if __name__ == "__main__":
    sys.exit(main())
