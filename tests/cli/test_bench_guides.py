"""The guides' benchmark and the MFU benchmark, each in its smallest CPU mode, write well-formed
output (not their numbers): every requested row present, skipped rows say why, ratios to vanilla."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, gpu, has_bitsandbytes as has_bnb


def bench(script, *args, cwd):
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], check=False, capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def test_guides_small_mode_writes_table_json_and_chart(tmp_path):
    out = bench("bench_guides.py", "--small", "--rows", "checkpointing,tf32", "--steps", "2",
                "--trainer-rows", "vanilla,checkpointing", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "guides_bench.md").read_text().splitlines()
    assert table[0].startswith("### bert_tiny, cpu, 2 steps per row, 1 thread(s)")
    head = table[2].strip("| ").split(" | ")
    assert head[:3] == ["run", "time s", "samples/s"] and "Trainer samples/s" in head
    rows = [line.strip("| ").split(" | ") for line in table[4:]]
    assert all(len(r) == len(head) for r in rows)
    # vanilla is added first (every ratio is to it); tf32 cannot run on a CPU and says so
    assert [r[0] for r in rows] == ["batch 4", "+ activation checkpointing", "batch 4, tf32"]
    vanilla, ckpt, tf32 = rows
    assert vanilla[3] == "1.00" and vanilla[head.index("memory x vanilla")] == "1.00"
    assert float(vanilla[head.index("Trainer samples/s")]) > 0
    assert ckpt[head.index("Trainer samples/s")].startswith("n/a: Trainer's gradient_checkpointing")
    assert tf32[1].startswith("skipped: TF32")
    data = json.loads((tmp_path / "guides_bench.json").read_text())
    assert [(r["row"], r["status"]) for r in data["rows"]] == [("vanilla", "ok"), ("checkpointing", "ok"),
                                                                ("tf32", "skipped")]
    assert data["reference_v100"]["vanilla"] == [8.86, 14949]
    v, c = data["rows"][:2]
    assert v["steps"] == c["steps"] == 2 and v["train_s"] > 0 and c["samples_per_s"] > 0
    assert v["trainer"]["status"] == "ok" and v["trainer"]["steps"] == 2 and v["trainer"]["peak_mem_mb"] > 0
    assert "+checkpointing=blocks" in c["overrides"] and c["speed_x"] > 0 and c["mem_x"] > 0
    assert (tmp_path / "guides_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each row's run directory keeps its metrics but not its (on a GPU, GBs large) final checkpoint
    assert (tmp_path / "runs" / "vanilla" / "metrics.jsonl").exists()
    assert not (tmp_path / "runs" / "vanilla" / "checkpoints").exists()
    # the planner against the run's peaks: one line per row that ran, each with both errors
    out = bench("plan_vs_peak.py", str(tmp_path / "guides_bench.json"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("| row | torch peak MB |") and [r.split(" | ")[0] for r in lines[2:]] == [
        "| batch 4", "| + activation checkpointing"]
    assert all(r.count("%") == 2 for r in lines[2:])


def test_guides_rejects_an_unknown_row(tmp_path):
    out = bench("bench_guides.py", "--small", "--rows", "vanilla,nope", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "unknown rows ['nope']" in out.stderr


def test_mfu_small_mode_writes_table_and_json(tmp_path):
    # fp32 (the first row), the chunked loss (a new row that runs on a CPU), fp8 (refused on a CPU)
    out = bench("bench_mfu.py", "--small", "--rows", "fp32,chunked,fp8", "--steps", "2", "--warmup", "1", "--out",
                str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "mfu_bench.md").read_text().splitlines()
    assert table[0].startswith("### tiny GPT") and "CPU" in table[0]
    assert table[2].startswith("| run | tokens/s | x first row | model TFLOP/s | measured peak TFLOP/s | MFU |")
    assert table[2].endswith("| micro-batch | peak MB | first step s | compile s | loss at end |")
    assert table[4].startswith("| fp32, foreach AdamW, SDPA |") and "%" in table[4]
    assert table[6].startswith("| fp8 matmuls (torchao) | refused: precision: fp8 needs a CUDA GPU")
    fp32, chunked, fp8 = json.loads((tmp_path / "mfu_bench.json").read_text())["rows"]
    assert fp32["steps"] == 2 and fp32["peak_dtype"] == "float32" and fp32["micro_batch"] == "8"
    assert fp32["tokens_per_s"] > 0 and fp32["peak_tflops"] > 0 and fp32["compile_s"] is None
    # MFU is the model's FLOP rate over the measured peak the run was given
    assert abs(fp32["mfu"] - fp32["tflops"] / fp32["peak_tflops"]) < 0.05 * fp32["mfu"]
    # the chunked loss trains exactly like the plain one (same seed, same data): same losses
    assert "loss=lm_chunked" in chunked["overrides"] and chunked["final_loss"] == pytest.approx(fp32["final_loss"], abs=1e-4)
    assert fp8["status"] == "refused" and "compute capability >= 8.9" in fp8["reason"]


@gpu
def test_mfu_gpu_eager_row(tmp_path):
    out = bench("bench_mfu.py", "--rows", "eager", "--steps", "2", "--warmup", "1", "--out", str(tmp_path),
                cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads((tmp_path / "mfu_bench.json").read_text())["rows"]
    assert row["peak_dtype"] == "bfloat16" and 0 < row["mfu"] < 1


def test_guides_gpu_table_sets_ours_against_the_v100_ratios():
    """The GPU layout (no GPU needed): NVML and torch columns, our multiples of vanilla next to the guides'."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_guides

    def row(name, sps, nvml, torch_mb, trainer=None):
        return {"row": name, "label": name, "status": "ok", "train_s": 60.0, "samples_per_s": sps,
                "mem_mb": nvml, "peak_mem_mb": torch_mb, **({"trainer": trainer} if trainer else {})}

    results = [row("vanilla", 20.0, 16000, 12000, {"status": "ok", "samples_per_s": 10.0, "mem_mb": 17000})
               | {"planned_mb": 11000.0},
               row("fp16", 40.0, 12000, 9000, {"status": "failed", "reason": "boom"}),
               {"row": "zero2_offload", "label": "zero", "status": "failed", "reason": "no deepspeed"}]
    bench_guides.add_ratios(results, gpu=True)
    assert results[1]["speed_x"] == 2.0 and results[1]["mem_x"] == 0.75
    assert results[1]["theirs_speed_x"] == 18.64 / 8.86 and results[1]["theirs_mem_x"] == 13939 / 14949
    lines = bench_guides.markdown(results, "t", gpu=True).splitlines()
    head = lines[2].strip("| ").split(" | ")
    assert head[:11] == ["run", "time s", "samples/s", "speed x vanilla", "V100 x", "NVML MB", "torch peak MB",
                         "planned MB", "memory x vanilla", "V100 x", "Trainer samples/s"]
    cells = [line.strip("| ").split(" | ") for line in lines[4:]]
    assert all(len(c) == len(head) for c in cells)
    assert cells[0][-1] == "2.00" and cells[1][-3] == "n/a: boom" and cells[0][7] == "11,000"
    assert cells[1][3:10] == ["2.00", "2.10", "12,000", "9,000", "-", "0.75", "0.93"]
    assert cells[2][1] == "failed: no deepspeed"


def test_engines_small_mode_writes_table_json_and_chart(tmp_path):
    pytest.importorskip("deepspeed")
    out = bench("bench_engines.py", "--small", "--rows", "local,zero2", "--steps", "2", "--out", str(tmp_path),
                cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    table = (tmp_path / "engines_bench.md").read_text().splitlines()
    assert table[0].startswith("### tiny GPT, cpu, 2 steps per row")
    rows = [line.strip("| ").split(" | ") for line in table[4:]]
    assert [r[0] for r in rows] == ["local engine, AdamW", "ZeRO-2, AdamW"] and rows[0][2] == "1.00"
    data = json.loads((tmp_path / "engines_bench.json").read_text())
    assert [r["row"] for r in data["rows"]] == ["local", "zero2"]
    assert all(r["steps"] == 2 and r["samples_per_s"] > 0 for r in data["rows"])
    assert "+engine=deepspeed" in data["rows"][1]["overrides"]
    assert (tmp_path / "engines_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "runs" / "local" / "model.safetensors").exists()  # bench rows keep no weights


def test_every_benchmark_row_composes_and_its_strategies_build():
    """Each row of bench_mfu.py (GPU and CPU) and bench_guides.py is a valid command line: Hydra
    composes it and every strategy group and the loss build (models are not built: GPT-2 small and
    BERT-large would cost seconds). GPU-only options may only be refused for want of a GPU."""
    from hydra import compose, initialize_config_module

    from looplib.cli.instantiate import check_settings, fill_strategy_defaults, instantiate
    from looplib.groups import appended_defaults
    from looplib.errors import ConfigError
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_guides
    import bench_mfu
    tables = [(bench_mfu.GPU_JOB, {k: v[1] for k, v in bench_mfu.GPU_ROWS.items()}),
              (bench_mfu.SMALL_JOB, {k: v[1] for k, v in bench_mfu.CPU_ROWS.items()}),
              (bench_guides.GPU_JOB, {k: [o.format(half="fp16") for o in v[1]] for k, v in bench_guides.ROWS.items()})]
    built = 0
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        for job, rows in tables:
            for name, overrides in rows.items():
                cfg = compose(config_name="config", overrides=[*job, *overrides, "device=cpu"])
                check_settings(cfg)
                fill_strategy_defaults(cfg)
                for group in (*appended_defaults(), "loss"):
                    if group == "engine" and "deepspeed" in cfg.engine._target_:
                        continue  # DeepSpeed's engine needs a launcher's environment
                    if group == "optim" and "Adam8bit" in cfg.optim._target_ and not has_bnb():
                        continue
                    try:
                        obj = instantiate(cfg, group)
                        if group == "precision":
                            obj.setup("cpu")
                        built += 1
                    except ConfigError as err:
                        assert not torch.cuda.is_available() and ("CUDA" in str(err) or "GPU" in str(err)), (name, err)
    assert built > 100
