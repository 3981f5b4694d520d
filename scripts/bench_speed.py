"""The speed strategies, each against its baseline in the same run: torch.compile, AdamW
kernels (for-loop / foreach / fused), TF32, SDPA attention kernels, half-precision evaluation.

    python scripts/bench_speed.py --quick          # smallest CPU mode: seconds to a minute or two
    python scripts/bench_speed.py                  # GPT-2-small shape on a GPU (bf16 training)

Prints a markdown table: tokens/s (median of timed steps after warm-up), peak memory on CUDA,
and the ratio to the row's baseline. Numbers are only comparable within one run on one machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext

import torch

from looplib import (BF16, AdamW, Compile, Engine, Evaluation, HalfWeights, Precision, TF32, TokenCrossEntropy,
                     TorchCompile, fit)
from looplib.data import RandomTokens, build_loader
from looplib.loop import TrainState
from looplib.models import GPT


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_speed(args, device, *, precision=None, impl="auto", compile_=None, attention=nullcontext):
    torch.manual_seed(0)
    model = (compile_ or Compile()).wrap(GPT(**args.model).to(device))
    precision = precision or (BF16() if device.type == "cuda" else Precision())
    precision.setup(device)
    data = RandomTokens(args.batch * (args.warmup + args.steps), args.model["seq_len"], args.model["vocab_size"])
    loader = build_loader(data, batch_size=args.batch, seed=0, device=device)
    opt = AdamW(lr=1e-4, weight_decay=0.1, impl=impl).build(model)
    state, times = TrainState(), []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    kw = dict(objective=TokenCrossEntropy(), optimizer=opt, precision=precision, engine=Engine(device), state=state)
    with attention():
        fit(model, loader, max_steps=args.warmup, **kw)  # warm-up (and compilation)
        for _ in range(args.steps):
            sync(device)
            t = time.perf_counter()
            fit(model, loader, max_steps=state.step + 1, **kw)
            sync(device)
            times.append(time.perf_counter() - t)
    tokens = args.batch * args.model["seq_len"]
    mem = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return tokens / statistics.median(times), mem


def eval_speed(args, device, evaluation):
    torch.manual_seed(0)
    model = GPT(**args.model).to(device)
    precision = BF16() if device.type == "cuda" else Precision()
    precision.setup(device)
    data = RandomTokens(args.batch * 4, args.model["seq_len"], args.model["vocab_size"])
    batches = list(build_loader(data, batch_size=args.batch, seed=0, shuffle=False, device=device))
    engine, times = Engine(device), []
    evaluation(model, batches[:1], TokenCrossEntropy(), precision, engine)  # warm-up
    for _ in range(args.steps):
        sync(device)
        t = time.perf_counter()
        evaluation(model, batches, TokenCrossEntropy(), precision, engine)
        sync(device)
        times.append(time.perf_counter() - t)
    return len(batches) * args.batch * args.model["seq_len"] / statistics.median(times), None


def sdpa_math():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (slow to compile)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if a.quick:
        a.model = dict(vocab_size=512, seq_len=64, n_layer=2, n_head=2, d_model=64)
        a.batch, a.warmup, a.steps = 4, 2, 5
    else:
        a.model = dict(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768)
        a.batch, a.warmup, a.steps = 8, 5, 20
    cuda = device.type == "cuda"
    rows = []  # (group, variant, (tokens/s, mem)), the first of each group is its baseline
    rows.append(("compile", "eager", train_speed(a, device)))
    if not a.no_compile:
        rows.append(("compile", "+compile=default", train_speed(a, device, compile_=TorchCompile())))
    for impl in ("for-loop", "foreach", "fused"):
        rows.append(("AdamW kernels", f"optim.impl={impl}", train_speed(a, device, impl=impl)))
    if cuda:
        rows.append(("tf32", "+precision=fp32", train_speed(a, device, precision=Precision())))
        rows.append(("tf32", "+precision=tf32", train_speed(a, device, precision=TF32())))
    rows.append(("attention", "math kernel", train_speed(a, device, attention=sdpa_math)))
    rows.append(("attention", "SDPA (auto: flash/efficient on CUDA)", train_speed(a, device)))
    rows.append(("evaluation", "+evaluation=as_trained", eval_speed(a, device, Evaluation())))
    rows.append(("evaluation", "+evaluation=bf16", eval_speed(a, device, HalfWeights("bfloat16"))))
    print(f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'} ({torch.get_num_threads()} threads), "
          f"model {a.model}, batch {a.batch}, torch {torch.__version__}\n")
    print("| group | variant | tokens/s | x baseline | peak memory MB |")
    print("|---|---|---|---|---|")
    base = {}
    for group, variant, (tps, mem) in rows:
        base.setdefault(group, tps)
        print(f"| {group} | {variant} | {tps:,.0f} | {tps / base[group]:.2f} | {'' if mem is None else f'{mem:,.0f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
