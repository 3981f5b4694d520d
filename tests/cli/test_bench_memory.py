"""The memory benchmark's smallest CPU mode writes a well-formed table, JSON and chart (not its numbers)."""
import json
import subprocess
import sys

from conftest import REPO


def test_small_mode_writes_table_json_and_chart(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_memory.py"), "--small", "--rows",
                          "vanilla,checkpointing", "--steps", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "memory_bench.md").read_text().splitlines()
    assert table[0].startswith("### bert_tiny (CPU)")
    assert table[2] == "| run | samples/s | x first row | peak memory MB | x first row | planned MB |"
    rows = [line.split(" | ") for line in table[4:]]
    assert [r[0] for r in rows] == ["| batch 4", "| + activation checkpointing"]
    assert all(float(c.replace(",", "").strip(" |")) > 0 for r in rows for c in r[1:])
    assert rows[0][2] == "1.00" and rows[0][4] == "1.00"
    data = json.loads((tmp_path / "memory_bench.json").read_text())
    assert [r["row"] for r in data["rows"]] == ["vanilla", "checkpointing"]
    assert all(r["steps"] == 2 and r["samples_per_s"] > 0 and r["planned_mb"] > 0 for r in data["rows"])
    assert "+checkpointing=blocks" in data["rows"][1]["overrides"]
    assert (tmp_path / "memory_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
