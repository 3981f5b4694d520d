"""The guides' benchmark and the MFU benchmark, each in its smallest CPU mode, write well-formed
output (not their numbers): every requested row present, skipped rows say why, ratios to vanilla."""
import json
import subprocess
import sys

from conftest import REPO, gpu


def bench(script, *args, cwd):
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], check=False, capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def test_guides_small_mode_writes_table_json_and_chart(tmp_path):
    out = bench("bench_guides.py", "--small", "--rows", "checkpointing,tf32", "--steps", "2",
                "--trainer-rows", "vanilla,checkpointing", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "guides_bench.md").read_text().splitlines()
    assert table[0].startswith("### bert_tiny, cpu, 2 steps per row")
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


def test_guides_rejects_an_unknown_row(tmp_path):
    out = bench("bench_guides.py", "--small", "--rows", "vanilla,nope", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "unknown rows ['nope']" in out.stderr


def test_mfu_small_mode_writes_table_and_json(tmp_path):
    out = bench("bench_mfu.py", "--small", "--rows", "fp32", "--steps", "2", "--warmup", "1", "--out",
                str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "mfu_bench.md").read_text().splitlines()
    assert table[0].startswith("### tiny GPT") and "CPU" in table[0]
    assert table[2] == "| run | tokens/s | x first row | model TFLOP/s | measured peak TFLOP/s | MFU |"
    assert table[4].startswith("| fp32, foreach AdamW, SDPA |") and table[4].endswith("% |")
    (row,) = json.loads((tmp_path / "mfu_bench.json").read_text())["rows"]
    assert row["steps"] == 2 and row["peak_dtype"] == "float32"
    assert row["tokens_per_s"] > 0 and row["peak_tflops"] > 0
    # MFU is the model's FLOP rate over the measured peak the run was given
    assert abs(row["mfu"] - row["tflops"] / row["peak_tflops"]) < 0.05 * row["mfu"]


@gpu
def test_mfu_gpu_eager_row(tmp_path):
    out = bench("bench_mfu.py", "--rows", "eager", "--steps", "2", "--warmup", "1", "--out", str(tmp_path),
                cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads((tmp_path / "mfu_bench.json").read_text())["rows"]
    assert row["peak_dtype"] == "bfloat16" and 0 < row["mfu"] < 1
