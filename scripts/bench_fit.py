"""Fitting the bigger model: QLoRA on a Llama-3-8B-shaped model under a memory cap, and the
activation strategies (none, blocks, selective, offload) side by side, each against the planner.

    python scripts/bench_fit.py --rows qlora8b --out results/fit          # GPU: 8B-shaped QLoRA under 16 GiB
    python scripts/bench_fit.py --rows qlora8b,qlora8b_fsdp --out results/fit   # GPU: and under FSDP2, one device
    python scripts/bench_fit.py --rows none,blocks,selective,offload --out results/fit   # GPU: GPT-2 small
    python scripts/bench_fit.py --small --out /tmp/fit                    # CPU: the tiny model, a smoke run

Each row is one ``python -m looplib.train`` process (with ``--cap-gib``, under
``torch.cuda.set_per_process_memory_fraction``: the allocator refuses what would pass the cap, as
a smaller GPU would). Written to --out: fit_bench.md (a markdown table), fit_bench.json. Per row:
samples/s (the median step after the first), the allocator's peak (``torch.cuda.max_memory_allocated``;
the CPU's peak RSS on a CPU), the planner's peak for the same overrides and its error, and the
planner's activation figures (on the device; in host memory for offload). qlora8b builds the
model from Llama-3-8B's config (random weights: no download), quantises its linear layers to NF4
on the GPU, and trains LoRA adapters at sequence 2048, batch 1, bf16, with block checkpointing;
qlora8b_fsdp runs the same job under ``+engine=fsdp`` as one process of torchrun (the 4-bit base in
FSDP2's float shards, ``looplib.peft.QLoRA``), planned per rank (``Plan.fsdp_4bit``), and the table
ends with its peak against the plain row's. With ``--small`` every row runs the tiny model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLAMA3_8B = ["model=hf", "model.model_type=llama", "+model.hidden_size=4096", "+model.intermediate_size=14336",
             "+model.num_hidden_layers=32", "+model.num_attention_heads=32", "+model.num_key_value_heads=8",
             "+model.vocab_size=128256", "+model.max_position_embeddings=8192", "+model.rope_theta=500000.0",
             "+model.tie_word_embeddings=false", "model.seq_len=2048", "data=random", "data.vocab_size=128256",
             "data.n_train=64", "batch_size=1", "+precision=bf16", "lr=1e-4"]
GPT2 = ["model=gpt2_small", "data=random", "data.vocab_size=50257", "batch_size=8", "+precision=bf16", "lr=1e-4"]
SMALL = ["model=tiny", "data=random", "model.n_layer=2", "model.d_model=64", "model.seq_len=64", "batch_size=8"]
ROWS = {  # name: (label, job, overrides)
    "qlora8b": ("Llama-3-8B-shaped, QLoRA (NF4, double quant), blocks, seq 2048 x 1, bf16",
                LLAMA3_8B, ["+peft=qlora", "peft.allow_random_base=true", "+checkpointing=blocks"]),
    "qlora8b_offload": ("Llama-3-8B-shaped, QLoRA, offload, seq 2048 x 1, bf16",
                        LLAMA3_8B, ["+peft=qlora", "peft.allow_random_base=true", "+checkpointing=offload"]),
    "qlora8b_fsdp": ("Llama-3-8B-shaped, QLoRA under FSDP2 on one device (torchrun, 1 process), blocks, seq 2048 x 1, "
                     "bf16", LLAMA3_8B, ["+peft=qlora", "peft.allow_random_base=true", "+checkpointing=blocks", "+engine=fsdp"]),
    "none": ("GPT-2 small, bf16, batch 8 x 1024, no checkpointing", GPT2, []),
    "blocks": ("GPT-2 small, +checkpointing=blocks", GPT2, ["+checkpointing=blocks"]),
    "selective": ("GPT-2 small, +checkpointing=selective", GPT2, ["+checkpointing=selective"]),
    "offload": ("GPT-2 small, +checkpointing=offload", GPT2, ["+checkpointing=offload"]),
    "offload_sync": ("GPT-2 small, +checkpointing=offload checkpointing.overlap=false", GPT2,
                     ["+checkpointing=offload", "checkpointing.overlap=false"]),
}
CAPPED = ("import torch, runpy, sys; torch.cuda.set_per_process_memory_fraction({fraction}); "
          "sys.argv = ['looplib.train'] + sys.argv[1:]; runpy.run_module('looplib.train', run_name='__main__')")


def plan(job: list[str], overrides: list[str], memory: int) -> dict:
    from hydra import compose, initialize_config_module

    from looplib.cli.plan import build_plan
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*job, *overrides, "device=cpu"])
    p = build_plan(cfg, memory=memory)
    mb = p.micro_batch
    if p.four_bit and p.engine == "fsdp":  # the 4-bit base sharded: the per-rank plan (one rank here)
        r = p.fsdp_4bit(1)
        return {"planned_peak_mb": r["peak"] / 2**20, "planned_static_mb": (r["peak"] - r["activations"]) / 2**20,
                "planned_weights_mb": (r["packed"] + r["constants"] + r["frozen"] + r["adapters"]) / 2**20,
                "planned_activations_mb": p.activations.device.at(mb) / 2**20,
                "planned_in_backward_mb": p.activations.transient.at(mb) / 2**20, "planned_host_mb": p.host.at(mb) / 2**20}
    return {"planned_peak_mb": p.peak(mb) / 2**20, "planned_static_mb": p.static / 2**20,
            "planned_weights_mb": p.weights / 2**20, "planned_activations_mb": p.activations.device.at(mb) / 2**20,
            "planned_in_backward_mb": p.activations.transient.at(mb) / 2**20, "planned_host_mb": p.host.at(mb) / 2**20}


def run(name: str, steps: int, device: str, out: Path, cap_gib: float | None, small: bool) -> dict:
    label, job, overrides = ROWS[name]
    job = SMALL if small else job
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # the benchmark's own run of this row: measured afresh
    args = [*job, *overrides, f"max_steps={steps}", f"device={device}", "log_every=1", "eval_every=0",
            "eval_samples=0", "sample_tokens=0", "progress=lines", "checkpoint.enabled=false", f"hydra.run.dir={run_dir}"]
    if cap_gib and device != "cpu":
        import torch
        fraction = cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
        command = [sys.executable, "-c", CAPPED.format(fraction=fraction), *args]
    else:
        command = [sys.executable, "-m", "looplib.train", *args]
    if "+engine=fsdp" in overrides:  # one process under torchrun (world size 1): the same command, launched
        script = out / "train_under_torchrun.py"  # torchrun runs a file: the command's -c / -m as one
        script.write_text(command[2] if command[1] == "-c" else
                          "import runpy, sys; sys.argv = ['looplib.train'] + sys.argv[1:]; "
                          "runpy.run_module('looplib.train', run_name='__main__')")
        from looplib.process.launcher import free_port
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                   str(free_port()), str(script), *command[3:]]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    result = {"row": name, "label": label, "overrides": overrides, "cap_gib": cap_gib, "wall_s": time.perf_counter() - t0,
              **plan(job, overrides, int((cap_gib or 80) * 2**30))}
    if done.returncode != 0:
        oom = "out of memory" in done.stderr.lower()
        return {**result, "status": "oom" if oom else "failed", "error": done.stderr[-1500:]}
    (run_dir / "model.safetensors").unlink(missing_ok=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    timed = train[1:] or train
    peak = max(r["peak_mem_mb"] for r in train)
    return {**result, "status": "ok", "steps": len(train), "samples_per_s": statistics.median(r["samples_per_s"] for r in timed),
            "peak_mem_mb": peak, "plan_error": result["planned_peak_mb"] / peak - 1, "final_loss": train[-1]["loss"],
            "fits": cap_gib is None or peak <= cap_gib * 1024}


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["row"] == "none" and r["status"] == "ok"), None)
    lines = ["| row | status | samples/s | x none | peak MB (allocator) | planned peak MB | error | planned activations "
             "MB (device + in backward) | planned host MB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ok = r["status"] == "ok"
        speed = f"{r['samples_per_s']:.2f}" if ok else "-"
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}" if ok and base else "-"
        peak = f"{r['peak_mem_mb']:,.0f}" + (f" (cap {r['cap_gib']:g} GiB)" if r["cap_gib"] else "") if ok else "-"
        error = f"{r['plan_error']:+.1%}" if ok else "-"
        lines.append(f"| {r['label']} | {r['status']} | {speed} | {ratio} | {peak} | {r['planned_peak_mb']:,.0f} | "
                     f"{error} | {r['planned_activations_mb']:,.0f} + {r['planned_in_backward_mb']:,.0f} | "
                     f"{r['planned_host_mb']:,.0f} |")
    plain, sharded = (next((r for r in results if r["row"] == name and r["status"] == "ok"), None)
                      for name in ("qlora8b", "qlora8b_fsdp"))
    if plain and sharded:  # QLoRA under FSDP2 on one device against the plain QLoRA row
        lines += ["", f"QLoRA under FSDP2 on one device / plain QLoRA: peak {sharded['peak_mem_mb']:,.0f} / "
                  f"{plain['peak_mem_mb']:,.0f} MB = {sharded['peak_mem_mb'] / plain['peak_mem_mb']:.3f} "
                  f"(planned {sharded['planned_peak_mb'] / plain['planned_peak_mb']:.3f}); samples/s "
                  f"{sharded['samples_per_s'] / plain['samples_per_s']:.2f}x"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="none,blocks,selective,offload")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cap-gib", type=float, default=None, help="memory cap (default: 16 for the qlora8b rows)")
    parser.add_argument("--small", action="store_true", help="the tiny model on the CPU (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("fit_bench"))
    args = parser.parse_args(argv)
    import torch
    device = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.rows.split(","):
        cap = args.cap_gib if args.cap_gib is not None else (16.0 if name.startswith("qlora8b") and not args.small
                                                             else None)
        results.append(run(name, args.steps, device, args.out, cap, args.small))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "error"}), flush=True)
        if results[-1]["status"] != "ok":
            print(results[-1]["error"], file=sys.stderr, flush=True)
        (args.out / "fit_bench.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "fit_bench.md").write_text(table(results))
    print(table(results))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
