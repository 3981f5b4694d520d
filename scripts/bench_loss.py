"""Peak memory and time of one loss + backward at GPT-2's vocabulary: the plain loss (``loss=lm``:
full logits, then cross-entropy) against the chunked one (``loss=lm_chunked``) and, on CUDA with
liger-kernel installed, Liger's fused kernel (``loss=lm_liger``).

    python scripts/bench_loss.py                    # CPU: 2048 tokens, width 768, vocabulary 50,257
    python scripts/bench_loss.py --device cuda --tokens 8192 --dtype bf16

Each variant runs in its own process, so the process's peak RSS (CPU) or the allocator's peak
(CUDA) is that variant's alone; the figure is the peak during loss + backward minus what was
held before it (hidden states, head weight, labels). The chunked loss must give the plain
loss's value and gradients (checked in the same run: the largest difference is reported).
Written to --out: loss_bench.md and loss_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("plain", "chunked", "liger")


def worker(args) -> dict:
    import torch
    import torch.nn.functional as F

    from looplib.loss import linear_cross_entropy
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(args.tokens, args.dim, generator=g) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.dim, generator=g) * 0.02).to(device).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    labels[::10] = -100
    if args.variant == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        fused = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if args.variant == "plain":
                loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
            elif args.variant == "chunked":
                loss = linear_cross_entropy(hidden, weight, None, labels, chunk_size=args.chunk)
            else:
                loss = fused(weight, hidden, labels)
        loss.backward()
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    loss = step()
    sync()
    first = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - before
    times = []
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    out = {"variant": args.variant, "peak_mb": peak / 2**20, "s": statistics.median(times or [first]), "loss": float(loss)}
    grads = {"hidden": hidden.grad.float().cpu(), "weight": weight.grad.float().cpu()}
    torch.save(grads, args.grads)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2048, help="rows: micro-batch x sequence")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--chunk", type=int, default=1024, help="loss.chunk_size")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="autocast dtype of the matmuls")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats after the measured one")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--out", type=Path, default=Path("bench_loss"))
    p.add_argument("--variants", default=None, help=f"subset of {','.join(VARIANTS)} (default: what can run)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--grads", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(worker(args)))
        return 0
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    import importlib.util
    names = (args.variants or ",".join(VARIANTS)).split(",")
    skipped = {}
    if "liger" in names and (not args.device.startswith("cuda") or importlib.util.find_spec("liger_kernel") is None):
        names.remove("liger")
        skipped["liger"] = "needs CUDA and liger-kernel (pip install 'looplib[liger]')"
    rows = []
    for name in names:
        grads = args.out / f"grads_{name}.pt"
        cmd = [sys.executable, __file__, "--variant", name, "--grads", str(grads), "--device", args.device,
               "--tokens", str(args.tokens), "--dim", str(args.dim), "--vocab", str(args.vocab), "--chunk",
               str(args.chunk), "--dtype", args.dtype, "--repeats", str(args.repeats)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{name:8} peak {rows[-1]['peak_mb']:9,.0f} MB  {rows[-1]['s'] * 1e3:9.1f} ms  loss {rows[-1]['loss']:.4f}",
              flush=True)
    import torch
    ref = torch.load(args.out / "grads_plain.pt") if "plain" in names else None
    base = rows[0]
    for row in rows:
        row["mem_x"], row["time_x"] = row["peak_mb"] / base["peak_mb"], row["s"] / base["s"]
        if ref is not None:
            got = torch.load(args.out / f"grads_{row['variant']}.pt")
            row["max_grad_diff"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
            row["loss_rel_diff"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
        (args.out / f"grads_{row['variant']}.pt").unlink()
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    title = (f"loss + backward, {args.tokens} tokens x width {args.dim} x vocabulary {args.vocab:,} "
             f"({args.dtype}, chunk {args.chunk}; {args.device}"
             f"{', ' + str(args.threads) + ' thread(s)' if args.device == 'cpu' else ''}); "
             f"fp32 logits alone: {logits_mb:,.0f} MB")
    lines = [f"### {title}", "", "| loss | peak MB (above inputs) | memory x plain | ms | time x plain | "
             "loss rel. diff | max grad diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['peak_mb']:,.0f} | {r['mem_x']:.3f} | {r['s'] * 1e3:,.1f} | "
                     f"{r['time_x']:.2f} | {r.get('loss_rel_diff', float('nan')):.1e} | "
                     f"{r.get('max_grad_diff', float('nan')):.1e} |")
    for name, why in skipped.items():
        lines.append(f"\n{name}: skipped, {why}")
    (args.out / "loss_bench.md").write_text("\n".join(lines) + "\n")
    (args.out / "loss_bench.json").write_text(json.dumps({"title": title, "args": {k: str(v) for k, v in vars(args).items()},
                                                          "skipped": skipped, "rows": rows}, indent=2))
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
