"""looplib beside what a user would pick instead: one job through looplib and through each peer,
in one run, each in its own process, on the same device, model shape, data, sequence length,
global batch, precision and number of steps; each framework with its own best documented settings.

    python scripts/bench_peers.py --out OUT                          # GPU: every workload, every peer
    python scripts/bench_peers.py --out OUT --workloads gpt2         # one workload (rows merge into OUT)
    python scripts/bench_peers.py --tiny --out OUT                   # CPU: tiny shapes, seconds per row

Workloads (scripts/peers/spec.py): ``pretrain`` (Llama-3.2-1B-shaped, random weights: looplib,
torchtitan, the HF Trainer), ``gpt2`` (GPT-2 small: looplib, the HF Trainer; llm.c's published
per-H100 rate as the record line), ``qlora`` (a Llama-3.2-3B-shaped base written once, NF4, LoRA on
every linear layer, instruct data, sequence 2048: looplib, the HF Trainer + peft + bitsandbytes,
unsloth), ``dpo`` (preference pairs, ``loss=dpo`` beside TRL's DPOTrainer, the rate in pairs/s:
scripts/peers/dpo.py). The data rows (and the initial weights, where a framework reads Hugging Face weights)
are written once into --work and read by every framework in the same order. Per row: tokens/s of
the median step after the warm-up steps (every input token of the global batch), the peak of the
allocator (peak RSS on a CPU), the loss at the last step, the settings, and a status: ``ok``,
``failed`` (the error's last line), ``timed out``, or ``not run`` (the peer cannot be installed or
run on this device: why). looplib's ratio to each peer follows (tokens/s, and peak memory).

``--tiny`` runs every workload the CPU can run at tiny sizes: looplib (its GPU settings with the
CPU's substitutes, named in the row), ``looplib_same`` (looplib on the Trainer's exact settings and
model: its losses must equal the Trainer's, tests/cli/test_bench_peers.py) and the HF Trainer; peers
that need a GPU (torchtitan, unsloth) get a ``not run`` row. Written to --out, after every row (a
run cut short keeps what finished; rows of other workloads already there stay): peers.md, peers.json
``{"device", "rows": [{"workload", "framework", "tokens_per_s", "peak_mem_mb", "loss", "settings",
"status", ...}], "ratios": ...}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
sys.path.insert(0, str(PEERS))
import dpo  # noqa: E402
from table import markdown, ratios, write  # noqa: E402,F401 (the table and its ratios)
from spec import WORKLOADS, job, write_data, write_model  # noqa: E402

# looplib's settings per workload (command-line overrides): its best known for the job. GPT-2 small leaves
# Liger's loss out and compiles the loss with the model (as the HF Trainer's torch_compile compiles GPT-2's
# forward with its loss): on an H200 (2026-11-28) this row with loss=lm_liger ran 149,586 tokens/s, with the
# plain loss uncompiled 340,195 (HF Trainer 320,785), and the ladder's rows at the same shapes ran compile
# 314,068, compile + loss compiled 400,890 at 0.58x the memory, Liger 156,006 (results/h200-2026-11-28-second).
LOOPLIB = {
    "pretrain": ["+precision=bf16", "+optim=adamw", "optim.impl=fused", "+compile=default", "loss=lm_liger"],
    "gpt2": ["+precision=bf16", "+optim=adamw", "optim.impl=fused", "model.pad_vocab_to=64", "+compile=default",
             "compile.loss=true"],
    "qlora": ["+precision=bf16", "+optim=adamw", "optim.impl=fused", "+checkpointing=blocks", "loss=lm_liger"],
    "dpo": dpo.LOOPLIB_SETTINGS["gpu"],
}
# a GPU machine here reaches no network: every library is told so, and fails fast instead of waiting on one
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
# what the CPU runs instead of a GPU-only setting (--tiny): named in the row's settings
CPU_SUBSTITUTES = {"loss=lm_liger": "loss=lm_chunked", "+compile=default": "+compile=default compile.backend=aot_eager"}
# The HF Trainer's settings (TrainingArguments): sdpa attention (the model's), torch_compile, bf16, fused
# AdamW, Liger's kernels where they cover the model (Llama; not GPT-2); QLoRA: transformers' gradient
# checkpointing (peft's prepare_model_for_kbit_training), no compile (bitsandbytes' 4-bit layers).
TRAINER = {
    "pretrain": {"bf16": True, "torch_compile": True, "optim": "adamw_torch_fused", "use_liger_kernel": True},
    "gpt2": {"bf16": True, "torch_compile": True, "optim": "adamw_torch_fused"},
    "qlora": {"bf16": True, "optim": "adamw_torch_fused", "gradient_checkpointing": True, "use_liger_kernel": True},
}
UNSLOTH = {"bf16": True, "optim": "adamw_torch_fused"}  # unsloth's own gradient checkpointing ("unsloth")
TINY_TRAINER = {"optim": "adamw_torch"}  # fp32, eager: what looplib_same runs too (+optim=adamw optim.impl=for-loop)
TINY_SHAPE = {"pretrain": "a 2-layer Llama, 64 wide, vocabulary 512", "gpt2": "a 2-layer GPT-2, 64 wide, vocabulary 512",
              "qlora": "a 2-layer Llama base, 64 wide, vocabulary 512",
              "dpo": "a 2-layer Llama, 64 wide, a BPE vocabulary of up to 512 trained on the pairs"}
ROW_LIMIT_S = {"pretrain": 90, "gpt2": 60, "qlora": 80, "dpo": 90}  # per row on a GPU (--row-limit overrides)


def settings_of(framework: str, workload: str, spec: dict, tiny: bool) -> tuple[list[str] | dict, str]:
    """(the framework's own settings, the words for the row). Common to every row of a workload:
    the spec's model, data, batch, steps, AdamW hyperparameters, clipping and seed."""
    if workload == "dpo" and framework in ("looplib", "trl"):
        side = "cpu" if tiny else "gpu"
        if framework == "trl":
            return dict(dpo.TRL_SETTINGS[side]), "DPOConfig " + ", ".join(f"{k}={v}" for k, v in
                                                                         dpo.TRL_SETTINGS[side].items())
        return list(dpo.LOOPLIB_SETTINGS[side]), " ".join(dpo.LOOPLIB_SETTINGS[side])
    if framework == "looplib":
        overrides = list(LOOPLIB[workload])
        if tiny:
            overrides = " ".join(CPU_SUBSTITUTES.get(o, o) for o in overrides).split()
            if spec["lora"] is None:
                overrides = [o for o in overrides if o != "+precision=bf16"]  # fp32 on a CPU (bf16 is emulated)
        words = " ".join(overrides) + (" (on the CPU: Liger -> lm_chunked, inductor -> aot_eager" +
                                        (", bf16 -> fp32)" if spec["lora"] is None else ")") if tiny else "")
        return overrides, words
    if framework == "looplib_same":
        overrides = ["+optim=adamw", "optim.impl=for-loop"] if tiny else ["+precision=bf16", "+optim=adamw",
                                                                        "optim.impl=fused", "+compile=default"]
        if spec["lora"] and not tiny:
            overrides.append("+checkpointing=blocks")
        if spec["lora"] and tiny:
            overrides.append("+checkpointing=blocks")
        return overrides, "the Trainer's settings and model through looplib: " + " ".join(overrides)
    if framework == "hf_trainer":
        args = dict(TINY_TRAINER if tiny else TRAINER[workload])
        if spec["lora"] and tiny:
            args["gradient_checkpointing"] = True
        return args, "TrainingArguments " + ", ".join(f"{k}={v}" for k, v in args.items()) + ", attn sdpa"
    if framework == "unsloth":
        return dict(UNSLOTH), ("unsloth FastLanguageModel (4-bit, its patched kernels), get_peft_model("
                               "use_gradient_checkpointing='unsloth'); HF Trainer " +
                               ", ".join(f"{k}={v}" for k, v in UNSLOTH.items()))
    if framework == "torchtitan":
        from titan import SETTINGS
        return {}, SETTINGS
    raise SystemExit(f"unknown framework {framework}")


def looplib_command(workload: str, spec: dict, overrides: list[str], run_dir: Path, model_dir: Path,
                    data_dir: Path) -> list[str]:
    """The looplib row: ``python -m looplib.train`` as a user types it, with the data rows as a data
    group of a user's own (scripts/peers/conf/data/token_file.yaml, PYTHONPATH=scripts/peers)."""
    if workload == "gpt2" and spec["framework"] == "looplib":  # looplib's bundled GPT in GPT-2 small's shape (its own initial weights)
        m = spec["model"]
        model = ["model=gpt2_small", f"model.n_layer={m['n_layer']}", f"model.n_head={m['n_head']}",
                 f"model.d_model={m['n_embd']}", f"model.seq_len={spec['seq_len']}"]
    else:
        model = ["model=hf", f"model.path={model_dir}", f"model.seq_len={spec['seq_len']}"]
    lora = []
    if spec["lora"]:
        lo = spec["lora"]
        lora = ["+peft=qlora", f"peft.r={lo['r']}", f"peft.alpha={lo['alpha']}", f"peft.dropout={lo['dropout']}",
                "peft.target_modules=[" + ",".join(lo["target_modules"]) + "]"]
    adamw = [f"optim.betas=[{spec['betas'][0]},{spec['betas'][1]}]", f"optim.eps={spec['eps']}"] \
        if "+optim=adamw" in overrides else []
    return [sys.executable, "-m", "looplib.train", "--config-dir", str(PEERS / "conf"), *model,
            "data=token_file", f"data.path={data_dir}", f"data.vocab_size={spec['model']['vocab_size']}",
            *lora, *overrides, *adamw, f"batch_size={spec['micro_batch']}", f"accum_steps={spec['accum']}",
            f"max_steps={spec['steps']}", f"lr={spec['lr']}", f"weight_decay={spec['weight_decay']}",
            f"max_grad_norm={spec['max_grad_norm']}", f"seed={spec['seed']}", f"device={spec['device']}",
            "log_every=1", "eval_every=0", "eval_samples=0", "sample_tokens=0", "checkpoint.enabled=false",
            "progress=lines", f"hydra.run.dir={run_dir}"]


def run_looplib(workload, spec, overrides, work: Path, limit: float) -> dict:
    run_dir = work / "runs" / f"{workload}-{spec['framework']}"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = dpo.looplib_command(spec, overrides, run_dir) if workload == "dpo" else \
        looplib_command(workload, spec, overrides, run_dir, work / f"{workload}-model", work / f"{workload}-data")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(PEERS), os.environ.get("PYTHONPATH", "")]),
           "LOOPLIB_PLOT": "0"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=limit)
    command = " ".join(args[1:])
    if done.returncode != 0:
        line = (done.stderr.strip().splitlines() or ["?"])[-1][:400]
        status = "not run" if done.returncode == 2 and "looplib: error:" in line else "failed"
        return {"status": status, "reason": line, "command": command}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    from measure import summary  # the same arithmetic as the other runners
    times = [r["step_time_s"] for r in train]
    result = summary(spec, times, [r["loss"] for r in train], _Device("cpu"))
    result["peak_mem_mb"] = max(r["peak_mem_mb"] for r in train)  # the run's own (allocator on a GPU)
    compiled = next((r for r in reversed(rows) if "compile_s" in r), {})
    result.update(status="ok", command=command, compile_s=compiled.get("compile_s"))
    result = dpo.pairs_per_s(spec, result) if workload == "dpo" else result
    for extra in (run_dir / "hf", run_dir / "model.safetensors"):  # the export: gigabytes for a 1B model
        shutil.rmtree(extra, ignore_errors=True) if extra.is_dir() else extra.unlink(missing_ok=True)
    return result


class _Device:  # measure.summary reads the peak from the device; looplib's rows carry their own
    def __init__(self, kind):
        self.type = kind


def run_runner(script: str, spec: dict, work: Path, limit: float) -> dict:
    """A peer's row: scripts/peers/SCRIPT with the spec, its last line the result."""
    path = work / "specs" / f"{spec['workload']}-{spec['framework']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    env = {**os.environ, **OFFLINE}
    done = subprocess.run([sys.executable, str(PEERS / script), str(path)], capture_output=True, text=True, env=env,
                          timeout=limit)
    lines = done.stdout.strip().splitlines()
    found = [line for line in lines if line.startswith("PEERS_RESULT ")]
    if done.returncode != 0 or not found:
        err = [line for line in done.stderr.strip().splitlines() if line.strip()]
        reason = next((line for line in reversed(err) if "Error" in line or "error" in line), err[-1] if err else "?")
        return {"status": "failed", "reason": reason[:400], "command": f"python scripts/peers/{script} {path}"}
    return {"status": "ok", **json.loads(found[-1].removeprefix("PEERS_RESULT "))}


def why_not(framework: str, device: str) -> str | None:
    """A peer that cannot be installed or run here: why (None: try it)."""
    needs = {"torchtitan": "torchtitan", "unsloth": "unsloth", "hf_trainer": "transformers", "trl": "trl"}.get(framework)
    if needs and importlib.util.find_spec(needs) is None:
        return f"{needs} is not installed (pip install {needs}; docs/testing.md lists the wheels for a GPU machine)"
    if framework == "unsloth" and not device.startswith("cuda"):
        return "unsloth runs on a GPU only (its Triton kernels; importing it without one raises)"
    if framework == "torchtitan" and not device.startswith("cuda"):
        return ("torchtitan 0.3.0 trains on an accelerator only: its model code imports triton (not in torch's "
                "CPU build), it picks cuda when no accelerator is found (torchtitan/tools/utils.py) and its "
                "memory monitor reads torch.cuda")
    return None


def run_row(workload: str, framework: str, spec: dict, work: Path, limit: float) -> dict:
    spec = dict(spec, framework=framework, model_dir=str(work / f"{workload}-model"),
                data_dir=str(work / f"{workload}-data"))
    settings, words = settings_of(framework, workload, spec, spec["tiny"])
    row = {"workload": workload, "framework": framework, "tokens_per_s": None, "peak_mem_mb": None, "loss": None,
           "settings": words}
    reason = why_not(framework, spec["device"])
    if reason:
        return {**row, "status": "not run", "reason": reason}
    t0 = time.perf_counter()
    try:
        if framework.startswith("looplib"):
            result = run_looplib(workload, spec, settings, work, limit)
        elif framework == "torchtitan":
            result = run_runner("titan.py", spec, work, limit)
        elif framework == "trl":
            result = run_runner("dpo.py", dict(spec, trainer=settings), work, limit)
        else:
            result = run_runner("hf_trainer.py", dict(spec, trainer=settings), work, limit)
    except subprocess.TimeoutExpired:
        result = {"status": "timed out", "reason": f"no result within its limit of {limit:.0f} s"}
    if result.get("notes"):  # what a runner had to change (a setting this machine cannot run)
        row["settings"] += " (" + "; ".join(result["notes"]) + ")"
    return {**row, **result, "settings": row["settings"], "wall_s": round(time.perf_counter() - t0, 1)}


def device_name(device: str) -> str:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({os.environ.get('OMP_NUM_THREADS', torch.get_num_threads())} thread(s))"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: every row in seconds")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {','.join(WORKLOADS)}")
    parser.add_argument("--frameworks", default=None, help="comma-separated subset (default: the workload's own; "
                        "--tiny adds looplib_same)")
    parser.add_argument("--out", type=Path, default=Path("bench_peers"))
    parser.add_argument("--work", type=Path, default=None, help="where the data rows and initial weights are written "
                        "once (default: --out/work with --tiny, else /tmp/looplib-peers: a 3B base is 6 GB)")
    parser.add_argument("--device", default=None, help="default: cpu with --tiny, cuda otherwise")
    parser.add_argument("--row-limit", type=float, default=None, help="seconds per row (default: per workload on a "
                        "GPU, 600 with --tiny)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per row (default 1 with --tiny)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run: a row gets at most "
                        "what is left; one that cannot start with 20 s left is written as not run (so the table "
                        "says which rows a time limit left out)")
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.tiny else "cuda")
    names = [w for w in args.workloads.split(",") if w]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    threads = args.threads or (1 if args.tiny else None)
    if threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    work = (args.work or (args.out / "work" if args.tiny else Path("/tmp/looplib-peers"))).resolve()
    name = device_name(device)
    previous = args.out / "peers.json"
    data = json.loads(previous.read_text()) if previous.exists() else {}
    if data.get("device") != name or bool(data.get("tiny")) != args.tiny:  # another device's rows: start afresh
        data = {}
    data.update(device=name, tiny=args.tiny, date=time.strftime("%Y-%m-%d"), command=" ".join([Path(sys.argv[0]).name,
                *(argv if argv is not None else sys.argv[1:])]))
    data.setdefault("rows", [])
    t_start = time.perf_counter()
    for workload in names:
        spec = dict(job(workload, args.tiny), device=device)
        frameworks = (args.frameworks.split(",") if args.frameworks else
                      WORKLOADS[workload]["frameworks"] + (["looplib_same"] if args.tiny and workload != "dpo" else []))
        frameworks = [f for f in frameworks if f]
        t0 = time.perf_counter()
        data_writer, model_writer = (dpo.write_data, dpo.write_model) if workload == "dpo" else (write_data, write_model)
        spec.update(data_dir=str(data_writer(spec, work / f"{workload}-data")))  # (dpo: pairs; a tokenizer trained on them)
        if any(f != "torchtitan" for f in frameworks) and importlib.util.find_spec("transformers"):
            model_writer(spec, work / f"{workload}-model", device=device if device.startswith("cuda") else "cpu")
        print(f"{workload}: data and initial weights in {work} ({time.perf_counter() - t0:.0f} s)", flush=True)
        limit = args.row_limit or (600 if args.tiny else ROW_LIMIT_S[workload])
        for framework in frameworks:
            left = args.budget_s - (time.perf_counter() - t_start) if args.budget_s else None
            if left is not None and left < 20:
                row = {"workload": workload, "framework": framework, "tokens_per_s": None, "peak_mem_mb": None,
                       "loss": None, "settings": settings_of(framework, workload, dict(spec, framework=framework),
                                                             args.tiny)[1],
                       "status": "not run", "reason": f"this run's time budget (--budget-s {args.budget_s:.0f}) was "
                       "spent before its turn"}
            else:
                row = run_row(workload, framework, spec, work, limit if left is None else min(limit, left))
            title = WORKLOADS[workload]["title"] + (f" (--tiny: {TINY_SHAPE[workload]}, sequence {spec['seq_len']}, "
                                                    "on the CPU)" if args.tiny else "")
            row.update(title=title, tiny=args.tiny, global_batch=spec["global_batch"],
                       seq_len=spec["seq_len"], steps=spec["steps"], warmup=spec["warmup"])
            data["rows"] = [r for r in data["rows"] if (r["workload"], r["framework"]) != (workload, framework)]
            data["rows"].append(row)
            write(args.out, data)
            figure = (f"{row['pairs_per_s']:,.1f} pairs/s" if row.get("pairs_per_s") else
                      f"{row['tokens_per_s']:,.0f} tokens/s") if row["status"] == "ok" else row.get("reason", "")
            print(f"{workload:<9} {framework:<13} {row['status']:<9} {figure}", flush=True)
    write(args.out, data)
    print("\n" + (args.out / "peers.md").read_text())
    print(f"written: {args.out}/peers.md, peers.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
