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
