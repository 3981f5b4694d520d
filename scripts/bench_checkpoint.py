"""The training time lost to each checkpoint, synchronous against asynchronous (checkpoint.async),
measured in one run with the two interleaved.

    python scripts/bench_checkpoint.py --out results/cpu-checkpoint              # ~100M parameters, CPU
    python scripts/bench_checkpoint.py --size 1b --device cuda --out OUT         # ~1B, a GPU (gpu_figures.sh checkpoint_stall)
    python scripts/bench_checkpoint.py --tiny --out /tmp/ckpt                    # seconds (CI: well-formed output)

One process trains a GPT with AdamW (fp32 weights and moments: what a checkpoint holds is 12
bytes per parameter) through looplib's loop, and writes its checkpoints through looplib's own
``Checkpoints`` (the files ``python -m looplib.train`` writes: safetensors, state.pt, manifest).
The run is cut into rounds of K optimizer steps, in the order plain, sync, plain, async, ...:
a sync round opens with a synchronous checkpoint, an async round with an asynchronous one and
ends when its background write has (the next checkpoint would wait for it). K is chosen from a
warm-up so that a round outlasts a background write. Per checkpoint:

    stall_s   how long the save held the loop: synchronous, the whole write; asynchronous, the
              copy off the device (pinned host memory on CUDA) and the thread's start
    lost_s    the round's time minus the plain rounds beside it (the mean of the one before and
              the one after, where there is one: the machine's load drifts): the stall, plus what the
              background write took from the steps beside it (CPU cores, memory bandwidth, the
              GIL), plus any wait at the round's end for a write that outlasted it
    write_s   the background write's own time (asynchronous)

The ratios are asynchronous over synchronous, of the medians. Goal: stall <= 0.2x. A warm-up round
of each kind runs first and is not counted (the first asynchronous save allocates its staging
buffers, which every later one reuses). Written to --out: checkpoint.md, checkpoint.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = {  # name: (d_model, n_layer, n_head, vocab, seq_len, batch)
    "tiny": (32, 1, 2, 64, 16, 2),
    "100m": (768, 12, 12, 16384, 64, 1),    # 85M in the blocks + 12.6M embedding (tied): 98M
    "1b": (2048, 20, 16, 32768, 512, 4),    # 1.01B in the blocks + 67M embedding: 1.07B
}


def build(size: str, device: str, root: Path):
    from looplib.data import Epochs, RandomTokens, build_loader
    from looplib.models import GPT
    from looplib.optim import AdamW
    from looplib.precision import BF16, FP32
    from looplib.store.saving import Checkpoints
    d, layers, heads, vocab, seq, batch = SIZES[size]
    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, d_model=d).to(device)
    optimizer = AdamW(lr=1e-4, impl="fused" if device == "cuda" else "auto").build(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    precision = BF16() if device == "cuda" else FP32()  # bf16 compute, fp32 weights and moments
    precision.setup(torch.device(device))
    epochs = Epochs(build_loader(RandomTokens(4096, seq, vocab), batch_size=batch, seed=0, device=torch.device(device)))
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, precision=precision, epochs=epochs)
    from looplib.engines import Engine
    engine = parts["engine"] = Engine(device)
    # one root for both (keep=1 over both): on disk at most the last complete checkpoint and one being written
    saved = {k: v for k, v in parts.items() if k != "engine"}
    sync = Checkpoints(root, keep=1, config={"bench": size}, engine=engine).bind(**saved)
    background = Checkpoints(root, keep=1, config={"bench": size}, engine=engine, asynchronous=True).bind(**saved)
    return parts, sync, background, sum(p.numel() for p in model.parameters())


class Trainer:
    def __init__(self, parts: dict, device: str):
        from looplib.loss import TokenCrossEntropy
        from looplib.train_state import TrainState
        self.parts, self.device, self.state = parts, device, TrainState()
        self.objective = TokenCrossEntropy()

    def steps(self, n: int) -> None:
        from looplib.loop import fit
        p = self.parts
        fit(p["model"], p["epochs"], objective=self.objective, optimizer=p["optimizer"], scheduler=p["scheduler"],
            precision=p["precision"], engine=p["engine"], max_steps=self.state.step + n, state=self.state)
        if self.device == "cuda":
            torch.cuda.synchronize()


def round_(trainer: Trainer, kind: str, k: int, sync, background) -> dict:
    """K steps; a checkpoint of ``kind`` at their start (none for ``plain``)."""
    t0 = time.perf_counter()
    stall = wait = 0.0
    if kind != "plain":
        ckpt = sync if kind == "sync" else background
        ckpt.save(trainer.state)
        stall = time.perf_counter() - t0
    trainer.steps(k)
    if kind == "async":
        w0 = time.perf_counter()
        background.settle()  # a write that outlasted the round: the next checkpoint would wait for it
        wait = time.perf_counter() - w0
    row = {"kind": kind, "round_s": time.perf_counter() - t0, "stall_s": stall, "end_wait_s": wait}
    if kind == "async":
        row["write_s"] = background.write_seconds[-1]
    return row


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(rows: list[dict]) -> dict:
    """Per kind: medians and ranges of stall and lost time (each round minus the plain rounds beside it)."""
    out = {}
    for kind in ("sync", "async"):
        lost, stall, write = [], [], []
        for i, r in enumerate(rows):
            beside = [rows[j]["round_s"] for j in (i - 1, i + 1) if 0 <= j < len(rows) and rows[j]["kind"] == "plain"]
            if r["kind"] == kind and beside:
                lost.append(r["round_s"] - sum(beside) / len(beside))
                stall.append(r["stall_s"])
                write += [r["write_s"]] if "write_s" in r else []
        out[kind] = {"checkpoints": len(lost), "stall_s": median(stall), "stall_range": [min(stall), max(stall)],
                     "lost_s": median(lost), "lost_range": [min(lost), max(lost)],
                     **({"write_s": median(write)} if write else {})}
    out["plain_round_s"] = median([r["round_s"] for r in rows if r["kind"] == "plain"])
    out["ratio"] = {"stall": out["async"]["stall_s"] / out["sync"]["stall_s"],
                    "lost": out["async"]["lost_s"] / out["sync"]["lost_s"]}
    return out


def table(s: dict, meta: dict) -> str:
    lines = [f"Checkpoint stall, synchronous against asynchronous ({meta['size']}: {meta['parameters'] / 1e6:.0f}M "
             f"parameters, {meta['checkpoint_mb']:.0f} MB per checkpoint, {meta['device']}; rounds of {meta['round_steps']} "
             f"steps, a plain round {s['plain_round_s']:.3f} s (median), {meta['repeats']} of each kind, interleaved)", "",
             "| checkpoint | checkpoints | stall s (median, range) | time lost s (median, range) | "
             "background write s | stall x sync | lost x sync |", "|---|---|---|---|---|---|---|"]
    for kind in ("sync", "async"):
        r = s[kind]
        x = (1.0, 1.0) if kind == "sync" else (s["ratio"]["stall"], s["ratio"]["lost"])
        lines.append(f"| {kind} | {r['checkpoints']} | {r['stall_s']:.3f} ({r['stall_range'][0]:.3f}-{r['stall_range'][1]:.3f}) | "
                     f"{r['lost_s']:.3f} ({r['lost_range'][0]:.3f}-{r['lost_range'][1]:.3f}) | "
                     f"{r.get('write_s', float('nan')):.3f} | {x[0]:.3f} | {x[1]:.3f} |")
    lines += ["", f"Goal: asynchronous stall <= 0.2x the synchronous one: {s['ratio']['stall']:.3f}x "
              f"({'met' if s['ratio']['stall'] <= 0.2 else 'NOT met'}). Load average before / after: "
              f"{meta['load_before']} / {meta['load_after']} on {meta['cpus']} CPUs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--tiny", action="store_true", help="the smallest run (CI): --size tiny, one repeat")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=4, help="rounds of each kind (sync, async), each after a plain one")
    parser.add_argument("--min-steps", type=int, default=3, help="the fewest steps in a round")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=Path("checkpoint_bench"))
    parser.add_argument("--summarise", type=Path, default=None,
                        help="no training: the summary and table of a checkpoint.json written before (its rounds)")
    args = parser.parse_args(argv)
    if args.summarise is not None:
        saved = json.loads(args.summarise.read_text())
        return write(args.out, saved["meta"], saved["rounds"])
    if args.tiny:
        args.size, args.repeats, args.min_steps = "tiny", 1, 2
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        parts, sync, background, n = build(args.size, args.device, root / "checkpoints")
        trainer = Trainer(parts, args.device)
        trainer.steps(2)  # first steps: allocations, the optimizer's state
        t0 = time.perf_counter()
        trainer.steps(2)
        step_s = (time.perf_counter() - t0) / 2
        warm = [round_(trainer, kind, args.min_steps, sync, background) for kind in ("plain", "sync", "async")]
        # a round outlasts the background write (with a margin), so it measures what the write costs the steps
        k = max(args.min_steps, math.ceil(1.5 * warm[2]["write_s"] / step_s))
        rows = []
        for _ in range(args.repeats):
            for kind in ("plain", "sync", "plain", "async"):
                rows.append(round_(trainer, kind, k, sync, background))
                print(json.dumps({k2: round(v, 4) if isinstance(v, float) else v for k2, v in rows[-1].items()}),
                      flush=True)
        newest = max((root / "checkpoints").glob("step-*"))
        mb = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / 2**20
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else " ".join(argv),
            "size": args.size, "parameters": n, "device": args.device if args.device != "cuda" else
            torch.cuda.get_device_name(0), "torch": torch.__version__, "round_steps": k, "step_s": step_s,
            "repeats": args.repeats, "checkpoint_mb": mb, "cpus": os.cpu_count(), "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "threads": torch.get_num_threads(), "warmup": warm}
    return write(args.out, meta, rows)


def write(out: Path, meta: dict, rows: list[dict]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(rows)
    (out / "checkpoint.json").write_text(json.dumps({"meta": meta, "summary": summary, "rounds": rows}, indent=1))
    text = table(summary, meta)
    (out / "checkpoint.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
