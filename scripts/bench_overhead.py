"""looplib's overhead against a hand-written PyTorch loop: same model, data, seed and steps.

    python scripts/bench_overhead.py                 # tiny and default GPT, 5 alternating pairs
    python scripts/bench_overhead.py --smoke         # seconds: for the test suite
    python scripts/bench_overhead.py --precision bf16 --device cuda

Each run is its own process (so the CPU's peak RSS is that run's alone), and runs of the two
loops alternate (plain, looplib, looplib, plain, ...) so that drift in machine speed hits both.
A run times `--steps` optimizer steps after `--warmup` steps, with one device sync at each end;
both loops read the loss from the device every `--log-every` steps, as looplib's telemetry does.
Where Hugging Face Accelerate is installed, the same training written the Accelerate way runs
too. Reported: the ratio of the median time per step (target: within 1%), the ratio of peak memory
(target: no more), and on CUDA the host-device syncs counted on non-logging steps
(`torch.cuda.set_sync_debug_mode`, target zero). Output: a markdown table and a JSON file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = {  # name -> GPT sizes, sequence length, micro-batch
    "tiny": dict(n_layer=2, n_head=2, d_model=64, seq_len=64, batch=8),
    "default": dict(n_layer=4, n_head=4, d_model=128, seq_len=128, batch=32),
    "smoke": dict(n_layer=1, n_head=2, d_model=32, seq_len=16, batch=4),
}


def setup(args):
    import torch
    from looplib import optim as lo
    from looplib.data import RandomTokens, build_loader
    from looplib.models import GPT

    size = dict(MODELS[args.model])
    batch, seq_len = size.pop("batch"), size["seq_len"]
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = GPT(vocab_size=2048, **size).to(device)
    n = batch * args.accum * (args.steps + args.warmup)
    loader = build_loader(RandomTokens(n, seq_len, 2048, seed=1), batch_size=batch, seed=2, device=device)
    optimizer = lo.AdamW(lr=1e-3, weight_decay=0.1).build(model)
    return torch, model, loader, optimizer, device


def plain_loop(args) -> dict:
    """The loop as the guides write it (with item-count normalisation, so both compute the same)."""
    torch, model, loader, optimizer, device = setup(args)
    import torch.nn.functional as F
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    batches = iter(loader)
    stamps, current = [], {"step": 0}
    sync_counter = count_syncs(torch, current, args.log_every) if device.type == "cuda" else None
    for step in range(args.warmup + args.steps):
        current["step"] = step  # steps done so far (looplib's telemetry counts the same way)
        if step == args.warmup:
            stamps.append(clock(torch, device))
        window = [next(batches) for _ in range(args.accum)]
        items = sum(int((b["labels"] != -100).sum()) for b in window)
        total = torch.zeros((), device=device)
        for batch in window:
            x = batch["input_ids"].to(device, non_blocking=True)
            y = batch["labels"].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / items
            scaler.scale(loss).backward()
            total += loss.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0:
            total.item()
    stamps.append(clock(torch, device))
    syncs = sync_counter() if sync_counter else None
    return {"s_per_step": (stamps[1] - stamps[0]) / args.steps, "syncs": syncs, **memory(torch, device)}


def accelerate_loop(args) -> dict:
    """The same training written the way Hugging Face Accelerate's documentation writes it."""
    torch, model, loader, optimizer, device = setup(args)
    import torch.nn.functional as F
    from accelerate import Accelerator
    accelerator = Accelerator(mixed_precision={"bf16": "bf16", "fp16": "fp16"}.get(args.precision, "no"),
                              gradient_accumulation_steps=args.accum, cpu=device.type == "cpu")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    stamps = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            stamps.append(clock(torch, device))
        total = torch.zeros((), device=device)
        for _ in range(args.accum):
            batch = next(batches)
            with accelerator.accumulate(model):
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
        if (step + 1) % args.log_every == 0:
            total.item()
    stamps.append(clock(torch, device))
    return {"s_per_step": (stamps[1] - stamps[0]) / args.steps, "syncs": None, **memory(torch, device)}


def fabric_loop(args) -> dict:
    """The same training written the way Lightning Fabric's documentation writes it."""
    torch, model, loader, optimizer, device = setup(args)
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator=device.type, devices=1,
                    precision={"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(args.precision, "32-true"))
    model, optimizer = fabric.setup(model, optimizer)
    batches = iter(fabric.setup_dataloaders(loader, move_to_device=True))
    stamps = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            stamps.append(clock(torch, device))
        total = torch.zeros((), device=device)
        for micro in range(args.accum):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accum - 1):
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten()) / args.accum
                fabric.backward(loss)
            total += loss.detach()
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0:
            total.item()
    stamps.append(clock(torch, device))
    return {"s_per_step": (stamps[1] - stamps[0]) / args.steps, "syncs": None, **memory(torch, device)}


PEERS = {"accelerate": "accelerate", "fabric": "lightning"}  # row -> the package it needs


def peers() -> list[str]:
    """Peer frameworks measured too, where installed."""
    import importlib.util
    return [row for row, package in PEERS.items() if importlib.util.find_spec(package) is not None]


def looplib_loop(args) -> dict:
    torch, model, loader, optimizer, device = setup(args)
    from looplib import FP16, FP32, BF16, Accumulation, Engine, Telemetry, TokenCrossEntropy, fit

    precision = {"bf16": BF16, "fp16": FP16}.get(args.precision, FP32)()
    if args.no_nonfinite_check or args.worker == "looplib-unchecked":
        precision.skip_nonfinite = False
    precision.setup(device)
    stamps, current = [], {"step": 0}

    class Clock(Telemetry):
        def step(self, step, *rest):
            super().step(step, *rest)
            current["step"] = step
            if step == args.warmup:
                stamps.append(clock(torch, device))

    telemetry = Clock(enabled=False, log_every=args.log_every, device=device)
    telemetry.write = lambda row: None
    if args.warmup == 0:
        stamps.append(clock(torch, device))
    sync_counter = count_syncs(torch, current, args.log_every) if device.type == "cuda" else None
    fit(model, loader, objective=TokenCrossEntropy(), optimizer=optimizer, max_steps=args.warmup + args.steps,
        precision=precision, accumulation=Accumulation(args.accum), engine=Engine(device), max_grad_norm=1.0,
        telemetry=telemetry)
    stamps.append(clock(torch, device))
    syncs = sync_counter() if sync_counter else None
    return {"s_per_step": (stamps[1] - stamps[0]) / args.steps, "syncs": syncs, **memory(torch, device)}


def count_syncs(torch, current: dict, log_every: int):
    """Count host-device syncs (CUDA's sync debug mode warns on each) in steps that do not log."""
    import warnings
    found = []

    def record(message, category, *rest):
        step = current["step"] + 1  # the step in progress
        if step != 1 and step % log_every != 0 and "synchroniz" in str(message):
            found.append(step)
    warnings.simplefilter("always")
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")

    def done():
        torch.cuda.set_sync_debug_mode("default")
        return len(found)
    return done


def clock(torch, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def memory(torch, device) -> dict:
    import resource
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def worker_cmd(args, which: str, model: str) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", which, "--model", model, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--accum", str(args.accum), "--device", args.device,
           "--precision", args.precision, "--log-every", str(args.log_every)]
    return cmd + (["--no-nonfinite-check"] if args.no_nonfinite_check else [])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,default")
    p.add_argument("--pairs", type=int, default=5, help="alternating (plain, looplib) pairs per model")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--no-nonfinite-check", action="store_true",
                   help="precision.skip_nonfinite=false: no per-step sync for the inf/NaN check")
    p.add_argument("--out", default="bench_overhead")
    p.add_argument("--smoke", action="store_true", help="one small pair: checks the script, not the numbers")
    p.add_argument("--worker", choices=["plain", "looplib", "looplib-unchecked", *PEERS], help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        loops = {"plain": plain_loop, "looplib": looplib_loop, "looplib-unchecked": looplib_loop,
                 "accelerate": accelerate_loop, "fabric": fabric_loop}
        print(json.dumps(loops[args.worker](args)))
        return 0
    if args.smoke:
        args.models, args.pairs, args.steps, args.warmup = "smoke", 1, 4, 1
    results = {}
    for model in args.models.split(","):
        # on CUDA also looplib without the per-step inf/NaN check (precision.skip_nonfinite=false): its sync's cost
        unchecked = ["looplib-unchecked"] if args.device.startswith("cuda") and not args.no_nonfinite_check else []
        loops = ["plain", "looplib", *unchecked, *peers()]
        runs = {name: [] for name in loops}
        for i in range(args.pairs):
            order = loops if i % 2 == 0 else loops[::-1]
            for which in order:
                out = subprocess.run(worker_cmd(args, which, model), capture_output=True, text=True, check=True)
                runs[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[model] = summarise(runs)
        write(results, args)  # after every model: a run cut short keeps what it measured
    write(results, args)
    return 0


def summarise(runs: dict) -> dict:
    med = {k: statistics.median(r["s_per_step"] for r in v) for k, v in runs.items()}
    peak = {k: max(r.get("peak_cuda_mb", r["peak_rss_mb"]) for r in v) for k, v in runs.items()}
    return {"median_s_per_step": med, "peak_mb": peak, "time_ratio": med["looplib"] / med["plain"],
            "memory_ratio": peak["looplib"] / peak["plain"], "looplib_syncs": runs["looplib"][0]["syncs"],
            "syncs": {k: v[0]["syncs"] for k, v in runs.items()},
            "ratios": {k: {"time": med[k] / med["plain"], "memory": peak[k] / peak["plain"]} for k in med},
            "runs": runs}


def fmt_syncs(found, steps: int, log_every: int) -> str:
    if found is None:
        return "-"  # not counted: no CUDA, or a loop that is not instrumented
    quiet = sum(1 for s in range(2, steps + 1) if s % log_every)
    return f"{found} in {quiet} steps"


def write(results: dict, args) -> None:
    import platform
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device, "precision": args.precision, "steps": args.steps, "accum": args.accum,
            "machine": platform.platform(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv)}
    (out / "overhead.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"Overhead vs a hand-written loop ({args.device}, {args.precision}, {meta['date']}; "
             f"`{meta['command']}`)", "",
             "| model | loop | s/step | time x plain | peak MB | memory x plain | syncs on non-logging steps |",
             "|---|---|---|---|---|---|---|"]
    for model, r in results.items():
        for loop, m in r["median_s_per_step"].items():
            ratio = r["ratios"][loop]
            lines.append(f"| {model} | {loop} | {m:.4f} | {ratio['time']:.3f} | {r['peak_mb'][loop]:.0f} | "
                         f"{ratio['memory']:.3f} | {fmt_syncs(r['syncs'][loop], args.steps + args.warmup, args.log_every)} |")
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
