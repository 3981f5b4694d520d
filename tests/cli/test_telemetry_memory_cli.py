"""MFU rows through the command line (the in-process tests: tests/unit/test_telemetry_memory.py)."""
import json
import pytest
from looplib.models import GPT


def test_cli_rows_have_mfu_with_a_given_peak(tmp_path):
    from conftest import run_cli
    out = run_cli("data=random", "max_steps=2", "batch_size=4", "log_every=1", "eval_samples=0", "sample_tokens=0",
                  "peak_tflops=0.5", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    model = GPT(512, 128, n_layer=4, n_head=4, d_model=128)
    for r in [r for r in rows if "loss" in r]:  # the step rows (a closing row holds the checkpoint's seconds)
        assert r["mfu"] == pytest.approx(r["samples_per_s"] * model.flops_per_sequence() / 0.5e12, rel=1e-9)
        assert 0 <= r["data_wait_share"] <= 1
