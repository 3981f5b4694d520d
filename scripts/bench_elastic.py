"""Elastic resume, the whole matrix: each engine's 2-process run checkpointed at step 2, resumed
from that checkpoint on 1, 2 and 4 processes and under the other engines it can load into, each
set against the uninterrupted 2-process run: the largest relative loss difference over the later
steps, the largest absolute weight difference, and the line the resume said.

    python scripts/bench_elastic.py --out results/cpu-elastic            # DDP, FSDP2, DeepSpeed ZeRO-2 and -3
    python scripts/bench_elastic.py --engines ddp --out /tmp/elastic     # one engine

The tests (tests/dist/test_engines_ddp.py, test_engines_fsdp.py, test_elastic.py) hold a subset of
this matrix to 1e-5 in CI; this script runs all of it (4 processes cost CI minutes) and reports
the figures. Written to --out: elastic.md, elastic.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

JOB = ["data=random", "max_steps=6", "log_every=1", "eval_every=0", "eval_samples=4", "sample_tokens=0",
       "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "batch_size=4",
       "accum_steps=2", "checkpoint.every_steps=2", "checkpoint.keep=5", "progress=lines"]
ENGINES = {"ddp": ["+engine=ddp"], "fsdp": ["+engine=fsdp"], "deepspeed": ["+engine=deepspeed", "engine.stage=2"],
           "zero3": ["+engine=deepspeed", "engine.stage=3"]}
# where each engine's checkpoint may be resumed (DeepSpeed's partitions load under DeepSpeed only)
TARGETS = {"ddp": [("ddp", 1), ("ddp", 2), ("ddp", 4), ("fsdp", 2), ("fsdp", 1)],
           "fsdp": [("fsdp", 1), ("fsdp", 2), ("fsdp", 4), ("ddp", 2), ("ddp", 1)],
           "deepspeed": [("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 4)],
           "zero3": [("zero3", 1), ("zero3", 4)]}


def launch(engine: str, nproc: int, extra: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    from looplib.process.launcher import free_port
    args = [*ENGINES[engine], *JOB, *extra, f"hydra.run.dir={run_dir}"]
    head = ([sys.executable, "-m", "looplib.train"] if nproc == 1 else
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
             str(free_port()), "-m", "looplib.train"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*head, *args], capture_output=True, text=True, env=env, timeout=900)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def compare(ref: Path, run: Path) -> tuple[float, float]:
    want, got = losses(ref), losses(run)
    later = [s for s in got if s > 2]
    loss = max(abs(got[s] - want[s]) / abs(want[s]) for s in later)
    a, b = load_file(ref / "model.safetensors"), load_file(run / "model.safetensors")
    weight = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    return loss, weight


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="ddp,fsdp,deepspeed,zero3")
    parser.add_argument("--out", type=Path, default=Path("elastic_bench"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for engine in args.engines.split(","):
        ref = args.out / "runs" / f"{engine}-2"
        subprocess.run(["rm", "-rf", str(ref)], check=True)
        done = launch(engine, 2, [], ref)
        if done.returncode != 0:
            rows.append({"from": engine, "to": "-", "status": "failed", "error": done.stderr[-800:]})
            continue
        step2 = ref / "checkpoints" / "step-00000002"
        for target, nproc in TARGETS[engine]:
            run = args.out / "runs" / f"{engine}-2-to-{target}-{nproc}"
            subprocess.run(["rm", "-rf", str(run)], check=True)
            t0 = time.perf_counter()
            done = launch(target, nproc, [f"resume={step2}"], run)
            row = {"from": f"{engine} x 2", "to": f"{target} x {nproc}", "wall_s": round(time.perf_counter() - t0, 1)}
            if done.returncode != 0:
                rows.append({**row, "status": "failed", "error": done.stderr.strip().splitlines()[-1:]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            said = re.findall(r"resume: (?:\d+ -> \d+ processes|engine )[^\n]*", done.stdout)
            loss, weight = compare(ref, run)
            rows.append({**row, "status": "ok", "said": said[0] if said else "(nothing changed: nothing said)",
                         "max_loss_rel": loss, "max_weight_abs": weight})
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "elastic.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    lines = ["| from | resumed as | status | largest loss difference (relative) | largest weight difference | "
             "what the resume said |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "ok":
            lines.append(f"| {r['from']} | {r['to']} | ok | {r['max_loss_rel']:.1e} | {r['max_weight_abs']:.1e} | "
                         f"{r['said']} |")
        else:
            lines.append(f"| {r['from']} | {r['to']} | {r['status']} | - | - | {r.get('error')} |")
    (args.out / "elastic.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
