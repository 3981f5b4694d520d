"""scripts/bench_fit.py's QLoRA rows in its tiny CPU mode (--small): the part memory_qlora_fsdp of
scripts/gpu_figures.sh runs the 8B-shaped job as it is and under FSDP2 as one process of torchrun;
here the tiny model, the same command (not its numbers)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, needs_bnb

pytestmark = needs_bnb


def test_the_gpu_part_runs_qlora_under_fsdp_in_the_tiny_cpu_mode(tmp_path):
    pytest.importorskip("peft")
    part = next(line for line in (REPO / "scripts" / "gpu_figures.sh").read_text().splitlines()
                if line.strip().startswith("memory_qlora_fsdp)"))
    assert "scripts/bench_fit.py --rows qlora8b,qlora8b_fsdp" in part
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_fit.py"), "--small", "--rows", "qlora8b_fsdp",
                          "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    (row,) = json.loads((tmp_path / "fit_bench.json").read_text())
    assert row["status"] == "ok" and row["steps"] == 2 and row["overrides"][-1] == "+engine=fsdp"
    assert row["planned_peak_mb"] > row["planned_weights_mb"] > 0  # the per-rank plan of a sharded 4-bit base
    run = tmp_path / "runs" / "qlora8b_fsdp"
    assert "FSDP: 1 processes" in (run / "train.log").read_text()  # under the FSDP engine, world size 1
    assert (run / "adapter" / "adapter_model.safetensors").exists()


def test_the_table_ends_with_fsdp_against_the_plain_row():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_fit import table
    finally:
        sys.path.pop(0)
    rows = [{"row": name, "label": name, "status": "ok", "samples_per_s": speed, "peak_mem_mb": peak, "cap_gib": 16,
             "planned_peak_mb": planned, "plan_error": planned / peak - 1, "planned_activations_mb": 1,
             "planned_in_backward_mb": 1, "planned_host_mb": 0}
            for name, speed, peak, planned in (("qlora8b", 2.0, 1000.0, 990.0), ("qlora8b_fsdp", 1.5, 960.0, 950.0))]
    assert table(rows).splitlines()[-1] == ("QLoRA under FSDP2 on one device / plain QLoRA: peak 960 / 1,000 MB = "
                                           "0.960 (planned 0.960); samples/s 0.75x")
