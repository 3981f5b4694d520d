"""Each benchmark script runs in its smallest mode and writes well-formed output (not its numbers)."""
import importlib.util
import json
import subprocess
import sys

from conftest import REPO


def test_overhead_benchmark_smoke(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_overhead.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "overhead.json").read_text())
    smoke = data["results"]["smoke"]
    installed = {"accelerate": "accelerate", "fabric": "lightning"}
    loops = {"plain", "looplib"} | {row for row, pkg in installed.items() if importlib.util.find_spec(pkg)}
    assert set(smoke["median_s_per_step"]) == loops == set(smoke["ratios"])
    assert smoke["time_ratio"] > 0 and smoke["memory_ratio"] > 0 and smoke["ratios"]["plain"]["time"] == 1.0
    assert data["meta"]["device"] == "cpu" and "bench_overhead.py" in data["meta"]["command"]
    table = (out / "overhead.md").read_text().splitlines()
    assert table[2].startswith("| model | loop |") and table[2].endswith("| syncs on non-logging steps |")
    assert smoke["syncs"] == {loop: None for loop in loops}  # counted on CUDA only
    assert sorted(line.split("|")[2].strip() for line in table[4:]) == sorted(loops)


def test_loss_benchmark_smoke(tmp_path):
    """scripts/bench_loss.py at a toy size: both losses agree, and the table holds their memory ratio."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_loss.py"), "--tokens", "256", "--dim", "16",
                        "--vocab", "3000", "--chunk", "32", "--repeats", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    plain, chunked = json.loads((tmp_path / "loss_bench.json").read_text())["rows"]
    assert (plain["variant"], chunked["variant"]) == ("plain", "chunked") and plain["mem_x"] == 1.0
    assert chunked["loss_rel_diff"] < 1e-6 and chunked["max_grad_diff"] < 1e-5
    assert chunked["mem_x"] == chunked["peak_mb"] / plain["peak_mb"]
    table = (tmp_path / "loss_bench.md").read_text().splitlines()
    assert table[2].startswith("| loss | peak MB (above inputs) | memory x plain |") and len(table) >= 6


def test_checkpoint_benchmark_tiny(tmp_path):
    """scripts/bench_checkpoint.py --tiny: a synchronous and an asynchronous checkpoint, each in a
    round after a plain one, and the table of their ratio (the figures: results/cpu-2026-11-27-checkpoint)."""
    import os
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_checkpoint.py"), "--tiny", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "checkpoint.json").read_text())
    assert [row["kind"] for row in data["rounds"]] == ["plain", "sync", "plain", "async"]
    s = data["summary"]
    assert s["sync"]["checkpoints"] == s["async"]["checkpoints"] == 1 and s["async"]["write_s"] > 0
    assert s["ratio"]["stall"] == s["async"]["stall_s"] / s["sync"]["stall_s"]
    assert data["meta"]["checkpoint_mb"] > 0 and len(data["meta"]["load_before"]) == 3
    assert data["meta"]["round_steps"] >= 2 and "--tiny" in data["meta"]["command"]
    table = (tmp_path / "checkpoint.md").read_text().splitlines()
    assert table[2].startswith("| checkpoint | checkpoints | stall s (median, range) | time lost s")
    assert [line.split("|")[1].strip() for line in table[4:6]] == ["sync", "async"]
    assert table[-1].startswith("Goal: asynchronous stall <= 0.2x the synchronous one: ")
