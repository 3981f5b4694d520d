"""torch.profiler over a few training steps of any looplib command line: where a step's time goes.

    python scripts/profile_step.py --out prof -- model=tiny data=random batch_size=8
    python scripts/profile_step.py --steps 3 --out prof_gpt2 -- model=gpt2_small data=random \
        data.vocab_size=50257 +precision=bf16 model.pad_vocab_to=64 +compile=default batch_size=8

The job is composed and built as `python -m looplib.train` would (same overrides) and run through
``train.run`` for ``--warmup + --steps`` optimizer steps; the profiler records the last ``--steps``
(after warm-up and compilation). Written to --out: trace.json (open it in https://ui.perfetto.dev
or chrome://tracing), profile.md (the operators and looplib functions by self time, host and
device) and profile.json (the same rows).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="profiled optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before the profiler starts (compilation)")
    p.add_argument("--out", type=Path, default=Path("profile_step"))
    p.add_argument("--rows", type=int, default=30, help="rows in profile.md")
    p.add_argument("--stack", action="store_true", help="record Python stacks (slower; the trace shows them)")
    p.add_argument("overrides", nargs="*", help="looplib overrides, after --")
    args = p.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_module
    from torch.profiler import ProfilerActivity, profile, schedule

    from looplib.cli.main import build_job
    from looplib.run.training import train

    total = args.warmup + args.steps
    fixed = [f"max_steps={total}", f"log_every={total}", "eval_every=0", "eval_samples=0", "sample_tokens=0",
             "checkpoint.enabled=false", "progress=lines"]
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*args.overrides, *fixed])
    job = build_job(cfg)
    cuda = job.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=args.warmup - 1 if args.warmup else 0,
                                                            warmup=1 if args.warmup else 0, active=args.steps),
                   record_shapes=False, with_stack=args.stack)
    # one profiler step per optimizer step, from a process-wide optimizer hook: the loop is untouched
    from torch.optim.optimizer import register_optimizer_step_post_hook
    handle = register_optimizer_step_post_hook(lambda *_: prof.step())
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with prof, tempfile.TemporaryDirectory() as tmp:
            train(job, Path(tmp))
    finally:
        handle.remove()
    prof.export_chrome_trace(str(args.out / "trace.json"))
    device_key = "self_device_time_total" if cuda else None
    events = prof.key_averages()
    rows = []
    for e in events:
        row = {"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
               "cpu_total_ms": e.cpu_time_total / 1e3}
        if device_key:
            row["self_device_ms"] = getattr(e, device_key, 0) / 1e3
        rows.append(row)
    rows.sort(key=lambda r: -r.get("self_device_ms", r["self_cpu_ms"]))
    per_step = lambda ms: ms / args.steps  # noqa: E731
    head = "| name | calls/step | self host ms/step | host total ms/step |" + (" self device ms/step |" if cuda else "")
    lines = [f"### {' '.join(args.overrides) or 'the default job'}: {args.steps} steps after {args.warmup} "
             f"({job.engine.device})", "", head, "|---|---|---|---|" + ("---|" if cuda else "")]
    for r in rows[:args.rows]:
        line = (f"| {r['name'][:80]} | {r['calls'] / args.steps:g} | {per_step(r['self_cpu_ms']):.3f} | "
                f"{per_step(r['cpu_total_ms']):.3f} |")
        lines.append(line + (f" {per_step(r['self_device_ms']):.3f} |" if cuda else ""))
    (args.out / "profile.md").write_text("\n".join(lines) + "\n")
    (args.out / "profile.json").write_text(json.dumps({"overrides": args.overrides, "steps": args.steps,
                                                       "warmup": args.warmup, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
