"""The memory planner against measured peaks: each row of a guides' table run (its JSON),
planned again on this machine (no GPU needed) and set against the allocator's peak it measured.

    python scripts/plan_vs_peak.py results/h100-2026-11-22/guides.json results/h100-2026-11-22/guides_more.json

Prints a markdown table: the measured peak ("torch peak MB": the CUDA allocator's on a GPU),
the old estimate (static + activations) and `Plan.peak`, each with its relative error. Rows
run through DeepSpeed are left out (the planner's ZeRO figures are per-rank model state).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plans(paths: list[Path]) -> list[tuple[str, float, float, float]]:
    from hydra import compose, initialize_config_module

    from looplib.cli.plan import build_plan
    out, seen = [], set()
    for path in paths:
        run = json.loads(path.read_text())
        for r in run["rows"]:
            if r["status"] != "ok" or "+engine=deepspeed" in r["overrides"] or r["row"] in seen:
                continue
            seen.add(r["row"])
            with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
                cfg = compose(config_name="config", overrides=[*run["job"], *r["overrides"], "device=cpu"])
            plan = build_plan(cfg, memory=1)
            old = plan.static + plan.activations.at(plan.micro_batch)
            out.append((r["label"], r["peak_mem_mb"], old / 2**20, plan.peak(plan.micro_batch) / 2**20))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path, help="guides_bench.json files (scripts/bench_guides.py)")
    args = parser.parse_args(argv)
    print("| row | torch peak MB | static + activations MB | error | planned peak MB | error |")
    print("|---|---|---|---|---|---|")
    for label, peak, old, new in plans(args.json):
        print(f"| {label} | {peak:,.0f} | {old:,.0f} | {old / peak - 1:+.1%} | {new:,.0f} | {new / peak - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
