"""The guides' whole table (BERT-large, 512 sequences of 512 tokens, one epoch), row by row,
through looplib's command line and, where `transformers` is installed, through the Hugging Face
Trainer on the same model shape and data, next to the guides' V100 figures.

    python scripts/bench_guides.py                       # GPU: every row, one epoch each (bert_large)
    python scripts/bench_guides.py --small               # CPU: a tiny BERT, a few steps per row (minutes)
    python scripts/bench_guides.py --small --rows vanilla,accumulation --steps 2 --trainer-rows vanilla

Each row runs in its own process (`python -m looplib.train`, or this script's Trainer worker),
so process-wide peaks belong to that row alone. Per row: training time (sum of step times),
samples/s (of the median step, the first step, warm-up, left out; the JSON has the mean too),
peak memory as NVML reports it (the whole device, CUDA context included: the guides' figure)
and as torch's allocator reports it (on a CPU: the process's peak RSS), and both as ratios
to the vanilla row of the same run. On a GPU the guides' V100 ratios stand next to ours
("theirs"): absolute figures differ by device, ratios should not. Rows a device cannot run
are listed with the reason (fp16 rows become bf16 on a CPU; tf32 and DeepSpeed offload rows
are skipped there). Written to --out: guides_bench.md, .json, .png.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import GPU_JOB, SMALL_JOB, chart, planned_mb, run_row

ACCUM = ["batch_size=1", "accum_steps=4"]
CKPT = ["+checkpointing=blocks"]
# name: (label, looplib overrides, Trainer arguments or None with the reason). {half} is fp16 on a
# GPU (the guides' choice) and bf16 on a CPU (torch's CPU autocast has no fp16 gradient scaling).
ROWS = {
    "vanilla": ("batch 4", ["batch_size=4"], {"per_device_train_batch_size": 4}),
    "accumulation": ("batch 1, accumulation 4", ACCUM,
                     {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4}),
    "checkpointing": ("+ activation checkpointing", ACCUM + CKPT, None),
    "fp16": ("batch 4, {half}", ["batch_size=4", "+precision={half}"],
             {"per_device_train_batch_size": 4, "{half}": True}),
    "fp16_all": ("accumulation + checkpointing + {half}", ACCUM + CKPT + ["+precision={half}"], None),
    "adafactor": ("batch 4, Adafactor", ["batch_size=4", "+optim=adafactor"],
                  {"per_device_train_batch_size": 4, "optim": "adafactor"}),
    "adafactor_all": ("Adafactor + accumulation + checkpointing + {half}",
                      ACCUM + CKPT + ["+precision={half}", "+optim=adafactor"], None),
    "adam8bit": ("batch 4, 8-bit Adam", ["batch_size=4", "+optim=adam8bit"],
                 {"per_device_train_batch_size": 4, "optim": "adamw_bnb_8bit"}),
    "adam8bit_all": ("8-bit Adam + accumulation + checkpointing + {half}",
                     ACCUM + CKPT + ["+precision={half}", "+optim=adam8bit"], None),
    "bf16": ("batch 4, bf16", ["batch_size=4", "+precision=bf16"],
             {"per_device_train_batch_size": 4, "bf16": True}),
    "tf32": ("batch 4, tf32", ["batch_size=4", "+precision=tf32"],
             {"per_device_train_batch_size": 4, "tf32": True}),
    "fused": ("batch 4, fused AdamW", ["batch_size=4", "+optim=adamw", "optim.impl=fused"],
              {"per_device_train_batch_size": 4, "optim": "adamw_torch_fused"}),
    "compile": ("batch 4, torch.compile", ["batch_size=4", "+compile=default"],
                {"per_device_train_batch_size": 4, "torch_compile": True}),
    "bf16_compile": ("batch 4, bf16, fused AdamW, torch.compile",
                     ["batch_size=4", "+precision=bf16", "+optim=adamw", "optim.impl=fused", "+compile=default"],
                     {"per_device_train_batch_size": 4, "bf16": True, "optim": "adamw_torch_fused",
                      "torch_compile": True}),
    "cuda_graphs": ("batch 4, bf16, fused AdamW, CUDA graphs (reduce-overhead)",
                    ["batch_size=4", "+precision=bf16", "+optim=adamw", "optim.impl=fused", "+compile=reduce_overhead"],
                    None),
    "fp8": ("batch 4, fp8 matmuls (torchao), fused AdamW, torch.compile",
            ["batch_size=4", "+precision=fp8", "+optim=adamw", "optim.impl=fused", "+compile=default"], None),
    "adam8bit_nosync": ("batch 4, 8-bit Adam, no inf/NaN step check (no per-step sync)",
                        ["batch_size=4", "+optim=adam8bit", "+precision=fp32", "precision.skip_nonfinite=false"], None),
    "adam8bit_ao": ("batch 4, torchao 8-bit AdamW (compiled step)", ["batch_size=4", "+optim=adam8bit_ao"], None),
    "fastest": ("fastest configuration looplib finds: bf16, fused AdamW, compiled model and loss, "
                "largest micro-batch (auto, global 32)",
                ["batch_size=auto", "global_batch_size=32", "+precision=bf16", "+optim=adamw", "optim.impl=fused",
                 "+compile=default", "compile.loss=true"], None),
    "zero2_offload": ("batch 4, DeepSpeed ZeRO-2, optimizer on CPU",
                      ["batch_size=4", "+engine=deepspeed", "engine.stage=2", "engine.offload_optimizer=cpu",
                       "+optim=cpu_adam"], None),
}
TRAINER_SKIP = {  # why a row has no Trainer twin
    "checkpointing": "Trainer's gradient_checkpointing needs a transformers model "
                     "(gradient_checkpointing_enable); the BertClassifier is plain PyTorch",
    "zero2_offload": "Trainer's DeepSpeed path needs the deepspeed launcher and its own JSON config",
    "cuda_graphs": "Trainer has no CUDA-graph option (torch_compile_mode is passed through, but not measured here)",
    "fp8": "Trainer's fp8 goes through Accelerate/TransformerEngine, not torchao",
    "adam8bit_nosync": "Trainer always checks for inf/NaN the same way; this row measures looplib's check",
    "adam8bit_ao": "Trainer's torchao optimizers are 4-bit and 8-bit AdamW via optim=adamw_torch_4bit/8bit; "
                   "not wired here",
    "fastest": "a looplib search (batch_size=auto); the Trainer's twins are the bf16, fused and compile rows",
    **{row: "needs gradient checkpointing (see that row)" for row in ("fp16_all", "adafactor_all", "adam8bit_all")},
}
CPU_SKIP = {
    "tf32": "TF32 is a CUDA tensor-core mode: on a CPU it is the fp32 vanilla row",
    "zero2_offload": "ZeRO-Offload moves optimizer state from the GPU to the CPU: nothing to offload on a CPU",
    "cuda_graphs": "CUDA graphs need a CUDA device (looplib refuses +compile=reduce_overhead on a CPU)",
    "fp8": "fp8 matmuls need a GPU of compute capability >= 8.9 (looplib refuses +precision=fp8 elsewhere)",
}
# The guides' figures (bert-large-uncased, V100 16 GB, one epoch): samples/s, GPU memory MB (NVML).
REFERENCE_V100 = {
    "vanilla": (8.86, 14949), "accumulation": (7.75, 8681), "checkpointing": (5.99, 6775),
    "fp16": (18.64, 13939), "fp16_all": (10.09, 7275), "adafactor": (7.96, 12295),
    "adafactor_all": (9.06, 4847), "adam8bit": (9.15, 13085), "adam8bit_all": (10.35, 5363),
}
SMALL_TRAINER_ROWS = "vanilla,accumulation"


def shape(job: list[str]) -> dict:
    """The model and data settings of the looplib job, composed by Hydra (the Trainer gets the same)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import looplib.cli.instantiate  # noqa: F401  (registers the ${looplib.*} resolvers conf/ uses)
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*job, "device=cpu"])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("_target_")
    return {"model": model, "n_train": cfg.data.n_train, "lr": cfg.lr, "weight_decay": cfg.weight_decay,
            "max_grad_norm": cfg.max_grad_norm}


def trainer_worker(spec: dict) -> dict:
    """One Trainer row in this process: the looplib BertClassifier under a {"loss": ...} wrapper."""
    import tempfile

    import torch
    import torch.nn.functional as F
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from looplib.data import RandomTokens
    from looplib.models import BertClassifier
    from looplib.telemetry import nvml_used_mb

    class WithLoss(torch.nn.Module):
        def __init__(self, **model):
            super().__init__()
            self.bert = BertClassifier(**model)

        def forward(self, input_ids, labels=None):
            logits = self.bert(input_ids)
            return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}

    device = torch.device(spec["device"])
    times, nvml = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                nvml.append(nvml_used_mb(device) or 0)
            times.append(time.perf_counter())

    torch.manual_seed(0)
    model, m = WithLoss(**spec["model"]), spec["model"]
    data = RandomTokens(spec["n_train"], m["seq_len"], m["vocab_size"], seed=0, num_classes=m["num_classes"])
    args = {k.format(half=spec["half"]): v for k, v in spec["args"].items()}
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(output_dir=tmp, max_steps=spec["steps"], learning_rate=spec["lr"],
                                  weight_decay=spec["weight_decay"], max_grad_norm=spec["max_grad_norm"] or 0.0,
                                  lr_scheduler_type="constant", report_to="none", save_strategy="no",
                                  logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
                                  use_cpu=device.type != "cuda", **args)
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        trainer.train()
    per_step = args.get("per_device_train_batch_size", 8) * args.get("gradient_accumulation_steps", 1)
    steps = [b - a for a, b in itertools.pairwise(times)] or [times[-1] - t0]  # the first step (warm-up) left out
    cuda = device.type == "cuda"
    optim = trainer.args.optim
    return {"optim": str(getattr(optim, "value", optim)), "steps": len(times),
            "samples_per_s": per_step / statistics.median(steps),
            "mean_samples_per_s": per_step * len(steps) / sum(steps), "train_s": times[-1] - t0,
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "device_mem_used_mb": max(nvml, default=0) or None}


def run_trainer_row(name: str, spec: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--trainer-worker", json.dumps(spec)], check=False,
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        return {"status": "failed", "reason": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


def torch_device_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else device


def ratio(a, b):
    return a / b if a and b else None


def add_ratios(results: list[dict], gpu: bool) -> None:
    """Speed and memory of each row as multiples of the first (vanilla) row; on a GPU the guides'
    V100 multiples too, to set ours against."""
    base = results[0] if results[0]["status"] == "ok" else {}
    for r in results:
        if r["status"] != "ok":
            continue
        r["speed_x"] = ratio(r["samples_per_s"], base.get("samples_per_s"))
        r["mem_x"] = ratio(r["mem_mb"], base.get("mem_mb"))
        if gpu and r["row"] in REFERENCE_V100:
            r["theirs_samples_per_s"], r["theirs_mem_mb"] = REFERENCE_V100[r["row"]]
            r["theirs_speed_x"] = r["theirs_samples_per_s"] / REFERENCE_V100["vanilla"][0]
            r["theirs_mem_x"] = r["theirs_mem_mb"] / REFERENCE_V100["vanilla"][1]


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def markdown(results: list[dict], title: str, gpu: bool) -> str:
    mem = "NVML MB" if gpu else "peak RSS MB"
    head = ["run", "time s", "samples/s", "speed x vanilla", "V100 x" if gpu else None, mem,
            "torch peak MB" if gpu else None,
            "planned MB" if gpu else None, "memory x vanilla", "V100 x" if gpu else None, "Trainer samples/s",
            "Trainer " + ("NVML MB" if gpu else "RSS MB"),
            "looplib / Trainer speed"]
    head = [h for h in head if h]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r["status"] != "ok":
            cells = [r["label"], f"{r['status']}: {r['reason']}"] + ["-"] * (len(head) - 2)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        t = r.get("trainer") or {}
        cells = [r["label"], f"{r['train_s']:.1f}", f"{r['samples_per_s']:.2f}", fmt(r["speed_x"])]
        cells += [fmt(r.get("theirs_speed_x")), fmt(r["mem_mb"], ",.0f"), fmt(r["peak_mem_mb"], ",.0f"),
                  fmt(r.get("planned_mb"), ",.0f"), fmt(r["mem_x"]), fmt(r.get("theirs_mem_x"))] if gpu else [fmt(r["mem_mb"], ",.0f"), fmt(r["mem_x"])]
        if t.get("status") == "ok":
            cells += [f"{t['samples_per_s']:.2f}", fmt(t["mem_mb"], ",.0f"), fmt(ratio(r["samples_per_s"],
                                                                                    t["samples_per_s"]))]
        else:
            cells += [("n/a: " + t["reason"]) if t else "-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CPU version: a tiny BERT, a few steps per row")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--trainer-rows", default=None, help="rows also run through the HF Trainer (default: "
                        f"all it supports on a GPU, {SMALL_TRAINER_ROWS} with --small; 'none' for none)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per row (default: one epoch, "
                        "128 steps of 4 sequences, on the GPU; 6 with --small)")
    parser.add_argument("--device", default=None, help="default: cpu with --small, cuda otherwise")
    parser.add_argument("--out", type=Path, default=Path("bench_guides"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per row (OMP_NUM_THREADS; default "
                        "1 with --small: a shared machine's oversubscribed cores stall multi-threaded steps)")
    parser.add_argument("--trainer-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer_worker:
        print(json.dumps(trainer_worker(json.loads(args.trainer_worker))))
        return 0
    names = [n for n in args.rows.split(",") if n]
    if "vanilla" not in names:
        names.insert(0, "vanilla")  # every ratio is to vanilla
    unknown = set(names) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {','.join(ROWS)}")
    device = args.device or ("cpu" if args.small else "cuda")
    gpu = device.startswith("cuda")
    threads = args.threads or (None if gpu else 1)
    if threads:  # inherited by every row's process
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    half = "fp16" if gpu else "bf16"
    steps = args.steps or (6 if args.small else 128)
    job = SMALL_JOB + [f"data.n_train={4 * steps}"] if args.small else GPU_JOB
    try:
        import transformers  # noqa: F401
        has_trainer = True
    except ImportError:
        has_trainer = False
    trainer_names = (args.trainer_rows or (",".join(ROWS) if gpu else SMALL_TRAINER_ROWS)).split(",")
    spec = {**shape(job), "device": device, "half": half, "steps": steps}
    args.out.mkdir(parents=True, exist_ok=True)
    model = "bert_tiny" if args.small else "bert_large"
    title = (f"{model}, {torch_device_name(device)}, {steps} steps per row" if gpu else
             f"{model}, {device}, {steps} steps per row, {threads} thread(s), memory: peak RSS")
    results = []
    for name in names:
        label, overrides, targs = ROWS[name]
        label = label.format(half=half) + (" (fp16 needs CUDA)" if not gpu and "{half}" in ROWS[name][0] else "")
        result = {"row": name, "label": label, "overrides": [o.format(half=half) for o in overrides]}
        results.append(result)
        if not gpu and name in CPU_SKIP:
            result.update(status="skipped", reason=CPU_SKIP[name])
            print(f"{label:<60} skipped: {CPU_SKIP[name]}", flush=True)
            continue
        try:
            result.update(status="ok", **run_row(name, result["overrides"], job, steps, device, args.out))
            # the median step, not the mean: robust to a shared machine's stalls (the mean is kept too)
            result["mean_samples_per_s"] = result["samples_per_s"]
            result["samples_per_s"] = result.pop("median_samples_per_s")
        except SystemExit as failed:
            result.update(status="failed", reason=str(failed).strip().splitlines()[-1][:300])
            print(f"{label:<60} failed: {result['reason']}", flush=True)
            write(results, args.out, title, job, steps, device, gpu, png=False)
            continue
        # NVML's figure on a GPU (torch's allocator peak where NVML cannot be read), peak RSS on a CPU
        result["mem_mb"] = ((result["device_mem_used_mb"] or result["peak_mem_mb"]) if gpu
                            else result["host_peak_rss_mb"])
        if has_trainer and name in trainer_names and args.trainer_rows != "none":
            if targs is None:
                result["trainer"] = {"status": "skipped", "reason": TRAINER_SKIP.get(name, "not a Trainer option")}
            else:
                t = run_trainer_row(name, {**spec, "args": targs})
                if t["status"] == "ok":
                    t["mem_mb"] = (t["device_mem_used_mb"] or t["peak_mem_mb"]) if gpu else t["peak_mem_mb"]
                result["trainer"] = t
        if gpu and "+engine=deepspeed" not in result["overrides"]:  # the planner's error against torch's peak
            try:
                result["planned_mb"] = planned_mb(job, result["overrides"], device)
                result["plan_error"] = result["planned_mb"] / result["peak_mem_mb"] - 1
            except Exception as error:  # the plan is a side figure: never lose a measured row to it
                result["plan_failed"] = str(error)[:200]
        write(results, args.out, title, job, steps, device, gpu, png=False)
        print(f"{label:<60} {result['samples_per_s']:8.2f} samples/s  {result['mem_mb'] or 0:10,.0f} MB  "
              f"({result['wall_s']:.0f} s)", flush=True)
    write(results, args.out, title, job, steps, device, gpu, png=True)
    print("\n" + (args.out / "guides_bench.md").read_text())
    print(f"written: {args.out}/guides_bench.md, .json, .png")
    return 0


def write(results: list[dict], out: Path, title: str, job: list[str], steps: int, device: str, gpu: bool,
          png: bool) -> None:
    """The table, the JSON and (at the end) the chart: rewritten after every row, so a run cut
    short (a time limit, a crash in one row) still leaves every finished row on disk."""
    add_ratios(results, gpu)
    (out / "guides_bench.md").write_text(markdown(results, title, gpu))
    (out / "guides_bench.json").write_text(json.dumps(
        {"title": title, "device": device, "job": job, "steps": steps, "reference_v100": REFERENCE_V100,
         "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": results}, indent=2))
    if png:
        ok = [dict(r, peak_mem_mb=r["mem_mb"]) for r in results if r["status"] == "ok"]
        chart(ok, title, out / "guides_bench.png")

if __name__ == "__main__":
    sys.exit(main())
